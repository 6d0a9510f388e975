"""scripts/eval_retrieval.py: the retrieval prompts as offline lm-eval tasks, run by lm-eval's completions and chat
clients against the server on loopback, answers read back in order."""

import json

import pytest

from dcp_jax.train.evaluate import examples_for
from scripts.eval_retrieval import parse_config, run_lm_eval, summarize, write_tasks
from tests.serving.serving_utils import http, start_server

pytest.importorskip("lm_eval")


def test_the_tasks_hold_the_evaluation_prompts(tmp_path):
    names = write_tasks(str(tmp_path), [64, 96], examples=3, seed=2)
    assert names == ["dsa_retrieval_64", "dsa_retrieval_96"]
    rows = [json.loads(line) for line in open(tmp_path / "dsa_retrieval_64.jsonl")]
    assert rows == [{"prompt": p, "target": a[:-1]} for p, a in examples_for(64, 3, seed=2)]
    assert f"test: {tmp_path}/dsa_retrieval_64.jsonl" in (tmp_path / "dsa_retrieval_64.yaml").read_text()


def test_configurations_are_parsed_and_bad_ones_refused():
    assert parse_config("dcp=2,interleave=2,index_cache=fp8") == {"name": "dcp=2,interleave=2,index_cache=fp8",
                                                                  "dcp": 2, "interleave": 2, "index_cache": "fp8"}
    assert parse_config("dcp=1,num_pages=4096")["num_pages"] == 4096
    assert parse_config("dense") == {"name": "dense", "dense": True}
    with pytest.raises(Exception, match="key=value"):
        parse_config("tp=2")


@pytest.mark.slow  # a server's compile and two lm-eval runs (~90 s); tests/serving/test_lm_eval.py runs both clients
def test_lm_eval_answers_the_task_through_both_clients(tmp_path_factory, tmp_path):
    """The answers lm-eval reads back, in the tasks' order, are the server's own greedy replies to the prompts."""
    server = start_server(tmp_path_factory)
    try:
        tasks = write_tasks(str(tmp_path / "tasks"), [64], examples=3, seed=0)
        per_client = {client: run_lm_eval(server.url, "tiny", client, tasks, str(tmp_path / "tasks"),
                                          str(tmp_path / client), 2)
                      for client in ("completions", "chat")}
        direct = {"completions": [], "chat": []}
        for prompt, _ in examples_for(64, 3, seed=0):
            request = dict(model="tiny", max_tokens=8, temperature=0, stop=[";"])
            _, _, body = http(server, "POST", "/v1/completions", request | {"prompt": prompt})
            direct["completions"].append(json.loads(body)["choices"][0]["text"])
            _, _, body = http(server, "POST", "/v1/chat/completions",
                              request | {"messages": [{"role": "user", "content": prompt}]})
            direct["chat"].append(json.loads(body)["choices"][0]["message"]["content"])
    finally:
        server.stop()
    for client, answers in per_client.items():
        assert answers["dsa_retrieval_64"] == direct[client], client
    results = {"configs": {"dcp=2": {client: {"64": {"accuracy": 0.0, "answers": answers["dsa_retrieval_64"]}}
                                     for client, answers in per_client.items()}}}
    assert "| dcp=2 | chat | 0.0 |" in summarize(results, [64])


def test_the_llm_client_answers_in_process_per_configuration(tmp_path):
    """Client `llm` (no server, no lm-eval): each configuration's LLM answers every prompt, greedy, stopped at ';'
    as lm-eval's generation is; the table and results name it, and each configuration's KV pool is recorded."""
    from scripts.eval_retrieval import main

    assert main(["--model", "tiny", "--out", str(tmp_path), "--contexts", "64", "--examples", "2", "--clients", "llm",
                 "--configs", "dcp=2,interleave=2,num_pages=40", "dense", "--max-num-seqs", "2"]) == 0
    results = json.load(open(tmp_path / "results.json"))
    assert results["llm_num_pages"]["dcp=2,interleave=2,num_pages=40"] == 40 and results["llm_num_pages"]["dense"] > 0
    for name in ("dcp=2,interleave=2,num_pages=40", "dense"):
        answers = results["configs"][name]["llm"]["64"]["answers"]
        assert len(answers) == 2 and all(";" not in answer and len(answer) <= 8 for answer in answers), answers
    assert "| dcp=2,interleave=2,num_pages=40 | llm |" in (tmp_path / "results.md").read_text()


def test_the_llm_client_records_the_mtp_drafts_acceptance(tmp_path, capsys):
    """With --num-speculative-tokens the trained model drafts with its MTP layer: its greedy answers stay right and
    the drafts' acceptance is recorded per context (from the engine's metrics); server clients are refused."""
    from scripts.eval_retrieval import main

    assert main(["--model", "dsa-tiny", "--out", str(tmp_path), "--contexts", "128", "--examples", "2", "--clients",
                 "llm", "--configs", "dcp=2", "--num-speculative-tokens", "2", "--max-num-seqs", "2"]) == 0
    result = json.load(open(tmp_path / "results.json"))["configs"]["dcp=2"]["llm"]["128"]
    assert result["accuracy"] == 1.0 and result["mtp_acceptance"] > 0.5  # the trained MTP layer drafts the value
    assert "| dcp=2 | llm: MTP drafts kept % |" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(["--model", "dsa-tiny", "--out", str(tmp_path), "--num-speculative-tokens", "1"])
    assert "in-process engine" in capsys.readouterr().err
