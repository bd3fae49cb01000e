"""Trainer offload/onload time of the host-copy backend (the fallback when torch_memory_saver is not usable).

    .venv/bin/python -m bench.offload                 # hidden 512, 8 layers (~30M params + AdamW state)
    .venv/bin/python -m bench.offload --quick         # hidden 256, 4 layers, 3 repeats

Moves the policy's parameters, gradients and AdamW moments to host copies (pinned on a GPU
build) and back, ``--repeats`` times, and reports the median seconds and GB/s of each direction.
On a CPU-only machine host and device are the same memory: the numbers are a memcpy's, and
the hand-off never offloads there (``offload_backend=auto`` picks nothing); on a GPU they are
the PCIe/NVLink-C2C copy the colocated hand-off pays every loop step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import save, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.repeats = 256, 4, 3

    from transformers import AutoModelForCausalLM, Qwen2Config

    from lightning_grpo.offload import HostOffload

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Qwen2Config(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (2, 32), device=device)
    model(ids, labels=ids).loss.backward()
    opt.step()  # AdamW state exists; gradients stay attached (they move too)
    off = HostOffload([model], [opt], device=device)
    times: dict[str, list[float]] = {"offload": [], "onload": []}
    moved = {"offload": 0, "onload": 0}
    for _ in range(args.repeats):
        for direction in ("offload", "onload"):
            start = time.perf_counter()
            moved[direction] = getattr(off, direction)()
            if device == "cuda":
                torch.cuda.synchronize()
            times[direction].append(time.perf_counter() - start)
    # On CPU the onload is the identity (the tensors already live on the host): 0 bytes moved.
    rows = [{"direction": d, "seconds": statistics.median(t), "GB/s": moved[d] / statistics.median(t) / 1e9,
             "bytes": moved[d]} for d, t in times.items()]
    print(table(rows, ["direction", "seconds", "GB/s", "bytes"]))
    params = sum(p.numel() for p in model.parameters())
    path = save("offload", {"device": device, "pinned": off.pin_memory, "params": params, "rows": rows})
    print(f"{params / 1e6:.1f}M params on {device}, pinned={off.pin_memory}; wrote {path}")


if __name__ == "__main__":
    main()
