"""Sampling defaults from a checkpoint's `generation_config.json` (no jax), as vLLM's `--generation-config`: auto
reads the model directory's, vllm reads none, a directory reads its own. They apply to what a request leaves unset.
"""

from __future__ import annotations

import json
import os

# generation_config.json's keys this engine takes, by the request field each sets.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(option: str, model_dir: str | None) -> dict[str, float]:
    """{request field: default} of `option` (auto | vllm | a directory) for the model in `model_dir`; ValueError for a
    directory that holds no generation_config.json. A config that does not sample (`do_sample` false) sets
    temperature 0, as transformers' generate would decode greedily."""
    if option == "vllm":
        return {}
    directory = model_dir if option == "auto" else option
    path = os.path.join(directory, "generation_config.json") if directory else None
    if path is None or not os.path.exists(path):
        if option != "auto":
            raise ValueError(f"--generation-config {option!r}: no generation_config.json there")
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    defaults = {key: config[key] for key in SAMPLING_KEYS if isinstance(config.get(key), (int, float))
                and not isinstance(config.get(key), bool)}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults
