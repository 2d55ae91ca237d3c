"""A step's grammar masks applied to its logits: the host path the engine had (unpack each row's
packed words into a vocabulary-wide bool mask, fill) against ``grammar_bitmask.mask_logits_``
(the words unpacked where the logits are), side by side, alternating, on random masks:

    PYTHONPATH=. .venv/bin/python bench/grammar_mask_apply_bench.py            # CPU, batch 8 and 32
    PYTHONPATH=. .venv/bin/python bench/grammar_mask_apply_bench.py --device cuda

On a CPU both paths run on the host and nothing is copied; on CUDA the host path's time includes
copying its bool mask to the device, the new path's the copy of the packed words (what
``MaskPlanner`` does every step). Prints median milliseconds per step and the bytes each copies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.gpu_worker.engine.grammar_bitmask import mask_logits_
from services.gpu_worker.engine.structured_output import unpack_bitmask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    vocab = args.vocab
    for batch in args.batch:
        g = torch.Generator().manual_seed(batch)
        words = torch.randint(-(2**31), 2**31, (batch, (vocab + 31) // 32), generator=g, dtype=torch.int64)
        bitmask = words.to(torch.int32)
        logits = torch.randn(batch, vocab, device=device)

        def host_path(logits=logits, bitmask=bitmask):
            return logits.masked_fill(~unpack_bitmask(bitmask, vocab).to(device), float("-inf"))

        def device_path(logits=logits, bitmask=bitmask):
            masked = logits.clone()
            mask_logits_(masked, bitmask.to(device))
            return masked

        if not torch.equal(host_path(), device_path()):
            raise SystemExit("the two paths disagree")
        times = {"host": [], "device": []}
        for _ in range(args.repeats):
            for name, run in (("host", host_path), ("device", device_path)):
                sync()
                start = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - start)
        host, on_device = (1e3 * statistics.median(times[k]) for k in ("host", "device"))
        print(
            f"{device.type}, batch {batch}, V={vocab}: host unpack {host:.2f} ms, on the logits' device "
            f"{on_device:.2f} ms ({host / on_device:.2f}x); a copy of {batch * vocab} bytes (bool) "
            f"-> {bitmask.numel() * 4} bytes (packed)"
        )


if __name__ == "__main__":
    main()
