#!/usr/bin/env bash
# Checks that the GPU tests catch broken Mosaic kernels: each mutation below is applied to a temporary copy of the
# tracked files, and scripts/test_gpu.sh runs its test there (the first-layer bf16 model test unless it names
# one); it must fail. Exits 1 when a
# mutation passes (the tests missed it) or no longer applies, 2 without a GPU (as test_gpu.sh). `--check` only
# checks that every mutation still applies (no GPU needed).
set -uo pipefail
cd "$(dirname "$0")/.."

# name | file | sed expression (each of its ';'-separated commands must change the file) [| test]; an entry's
# quoted pieces on continued lines join into one word
MUTATIONS=(
  "sparse-MLA scale without log2(e)|pallas_kernels/_sparse_mla_mosaic.py|s/scale=sm_scale \* LOG2E,/scale=sm_scale,/"
  "fp8 latent dequantized without the sign of one value in four|pallas_kernels/_sparse_mla_mosaic_gather.py|"\
"s/and.b32 a, a, 0x80008000/and.b32 a, a, 0x00008000/|"\
"tests/kernels/test_sparse_mla.py::test_mosaic_fp8_latent_cache_every_e4m3_byte_on_gpu"
  "indexer ReLU after the head sum|pallas_kernels/_indexer_mosaic.py|"\
"s/weighted = jnp.maximum(dots, 0.0) \* weights/weighted = dots * weights/;"\
"s/logits = jnp.sum(\(weighted\[.*\]\), axis=1) \* scales/logits = jnp.maximum(jnp.sum(\1, axis=1), 0.0) * scales/"
)
TEST=tests/model/test_deepseek_v32_gpu.py::test_bf16_first_layer_on_mosaic_kernels_equals_reference_kernels

# The copies have no .venv: they use this tree's, where it exists (test_gpu.sh checks that it sees a GPU).
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && export PYTHON="$PWD/.venv/bin/python"
status=0
for mutation in "${MUTATIONS[@]}"; do
  IFS='|' read -r name file expression test <<<"$mutation"
  IFS=';' read -ra edits <<<"$expression"
  stale=0
  for edit in "${edits[@]}"; do  # each of a mutation's sed commands must change the file
    sed "$edit" "$file" | cmp -s "$file" - && stale=1
  done
  if [ "$stale" = 1 ]; then
    echo "test_gpu_mutations: '$name' no longer applies to $file" >&2
    status=1
    continue
  fi
  if [ "${1:-}" = --check ]; then
    echo "applies: $name"
    continue
  fi
  copy=$(mktemp -d)
  git ls-files -z | xargs -0 cp --parents -t "$copy"
  sed -i "$expression" "$copy/$file"
  (cd "$copy" && bash scripts/test_gpu.sh "${test:-$TEST}" -q >"$copy/log" 2>&1)
  rc=$?
  if [ "$rc" = 2 ]; then cat "$copy/log" >&2; rm -rf "$copy"; exit 2; fi
  if [ "$rc" = 1 ] && grep -q "1 failed" "$copy/log"; then
    echo "caught: $name ($(grep -m1 -E '^E +assert' "$copy/log" | sed 's/^E *//'))"
  else
    echo "MISSED: $name (test_gpu.sh exit $rc)"; tail -5 "$copy/log"; status=1
  fi
  rm -rf "$copy"
done
exit $status
