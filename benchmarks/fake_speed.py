"""How long a fake-mode profile of a Llama with 7B sizes takes (meta device, bf16, seq 4096,
an H100 preset): 2 layers (target 30 s) and the full 32 (target 60 s) on this project's
2-core machine; measured about 2-3 s for the 32 layers.

Usage (from the repository root; needs transformers)::

    python -m benchmarks.fake_speed [--layers 2 32] [--repeats 1]

Prints each trace's seconds; the unit tests (``tests/profiling/test_fake.py``:
``test_llama_two_layers_fake_bytes_by_formula``, ``test_llama_7b_fake_bytes_by_formula``)
check the saved bytes by formula, not the time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memfit.profiling.tracer import trace

TARGET_S = {2: 30.0, 32: 60.0}


def llama(n_layer: int, seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=n_layer,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=seq, attn_implementation="eager", tie_word_embeddings=False,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    for n in args.layers:
        model, inputs = llama(n, args.seq)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            trace(model, inputs, mode="fake", target="h100")
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        target = TARGET_S.get(n)
        print(f"llama {n} layers, seq {args.seq}: runs {', '.join(f'{t:.2f}' for t in times)} s, "
              f"median {med:.2f} s" + (f" (target {target:g} s)" if target else ""))


if __name__ == "__main__":
    main()
