"""dcp_jax/serving/engine_args.py: one set of engine arguments. `serve` and `generate` take every field with its one
default, `plan` and the benchmarks a subset with the same defaults, `LLM` and `Engine` take them as keywords
(vLLM's names as aliases), and no entry point keeps a default of its own."""

import argparse
import dataclasses
import importlib
import inspect

import pytest

from dcp_jax import cli
from dcp_jax.serving.engine_args import DEFAULT_MODEL, EngineArgs

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_serve_and_generate_take_every_engine_argument_with_its_one_default(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    args = _subparser(command).parse_args(extra)
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert all(hasattr(args, name) for name in FIELDS)


def test_plan_and_the_benches_take_their_engine_arguments_with_the_same_defaults():
    plan = _subparser("plan").parse_args([])
    assert EngineArgs.from_cli_args(plan) == EngineArgs(model=cli.PLAN_DEFAULTS["model"])
    for name in ("bench_decode", "bench_engine", "bench_prefill"):
        module = importlib.import_module(f"bench.{name}")
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        defaults = vars(parser.parse_args([]))
        taken = {field: defaults[field] for field in module.ENGINE_ARGUMENTS}
        assert taken == {field: getattr(EngineArgs(), field) for field in module.ENGINE_ARGUMENTS}, name
        assert "page_size" in taken, name


def test_vllm_flags_and_the_projects_flags_mean_the_same():
    parser = _subparser("serve")
    vllm = parser.parse_args(["-tp", "4", "-dcp", "2", "--block-size", "16", "--dcp-kv-cache-interleave-size", "2",
                              "--num-gpu-blocks-override", "40", "--kv-cache-dtype", "fp8", "-q", "fp8", "-ep"])
    ours = parser.parse_args(["--tp", "4", "--dcp", "2", "--page-size", "16", "--interleave", "2", "--num-pages",
                              "40", "--kv-cache-dtype", "fp8", "--quantization", "fp8", "--enable-expert-parallel"])
    assert EngineArgs.from_cli_args(vllm) == EngineArgs.from_cli_args(ours)
    args = EngineArgs.from_cli_args(vllm)
    assert (args.tensor_parallel_size, args.dcp, args.page_size, args.num_pages) == (4, 2, 16, 40)
    assert (args.latent_cache_format, args.index_cache_format) == ("fp8", "fp8")


def test_the_python_api_takes_fields_and_vllms_aliases_and_refuses_the_rest():
    by_alias = EngineArgs.from_kwargs(tensor_parallel_size=4, decode_context_parallel_size=2, block_size=16,
                                      dcp_kv_cache_interleave_size=2, num_gpu_blocks_override=40)
    assert by_alias == EngineArgs(tp=4, dcp=2, page_size=16, interleave=2, num_pages=40)
    with pytest.raises(TypeError, match="unknown engine argument 'pagesize'"):
        EngineArgs.from_kwargs(pagesize=4)
    with pytest.raises(TypeError, match="'page_size' given twice"):
        EngineArgs.from_kwargs(page_size=4, block_size=8)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of"):
        EngineArgs(kv_cache_dtype="int8")
    assert EngineArgs(model="x").tensor_parallel_size == 1 and EngineArgs(dcp=4).tensor_parallel_size == 4


def test_kv_cache_dtype_sets_both_caches_and_the_finer_flags_win():
    assert (EngineArgs().latent_cache_format, EngineArgs().index_cache_format) == ("exact", "exact")
    fp8 = EngineArgs(kv_cache_dtype="fp8")
    assert (fp8.latent_cache_format, fp8.index_cache_format) == ("fp8", "fp8")
    mixed = EngineArgs(kv_cache_dtype="fp8", latent_cache="exact")
    assert (mixed.latent_cache_format, mixed.index_cache_format) == ("exact", "fp8")


def test_llm_engine_and_load_model_keep_no_defaults_of_their_own():
    from dcp_jax.serving.engine import Engine
    from dcp_jax.serving.llm import LLM
    from dcp_jax.serving.loading import load_model

    llm = inspect.signature(LLM.__init__).parameters
    assert list(llm) == ["self", "model", "kwargs"] and llm["model"].default == DEFAULT_MODEL == EngineArgs().model
    engine = inspect.signature(Engine.__init__).parameters
    assert list(engine) == ["self", "model", "prompt_logprobs", "progress", "kwargs"]
    assert engine["model"].default == DEFAULT_MODEL
    assert list(inspect.signature(load_model).parameters) == ["args", "distributed"]
    with pytest.raises(TypeError, match="unknown engine argument 'page_sizes'"):
        LLM("tiny", page_sizes=4)


def test_the_compilation_cache_is_on_by_default_under_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("DCP_JAX_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("DCP_JAX_CACHE_ROOT", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineArgs().compilation_cache == str(tmp_path / ".cache" / "dcp-jax" / "xla")
    monkeypatch.setenv("DCP_JAX_CACHE_ROOT", str(tmp_path / "root"))
    assert EngineArgs().compilation_cache == str(tmp_path / "root" / "xla")
    assert EngineArgs(compilation_cache_dir="/elsewhere").compilation_cache == "/elsewhere"
    monkeypatch.setenv("DCP_JAX_DISABLE_COMPILE_CACHE", "1")
    assert EngineArgs().compilation_cache is None
    assert EngineArgs(compilation_cache_dir="/elsewhere").compilation_cache == "/elsewhere"
