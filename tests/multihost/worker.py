"""One process of a multi-host test deployment: `LLM` with the deployment's arguments, greedy generation of the
given prompts, the token ids printed as one JSON line (every process prints the leader's outputs).

  python -m tests.multihost.worker --coordinator-address 127.0.0.1:PORT --num-processes 2 --process-id I --dcp 4
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator-address", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--dcp", type=int, required=True)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=64)
    args = parser.parse_args(argv)

    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.serving.llm import LLM

    llm = LLM("tiny", dcp=args.dcp, interleave=args.interleave, max_model_len=args.max_model_len, max_num_seqs=4,
              page_size=4, dtype="float32", kernels="reference", coordinator_address=args.coordinator_address,
              num_processes=args.num_processes, process_id=args.process_id)
    print("ready", flush=True)  # loaded and connected: a fault test may kill a process now
    outputs = llm.generate(prompt_token_ids=json.loads(args.prompts),
                           sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    print(json.dumps([out.outputs[0].token_ids for out in outputs]), flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
