"""The run's markdown summary (printed; ``bench/gpu_run.sh`` keeps it as gpu_checklist.md), one
section per part, from the result that gpu_checklist.json holds."""

from __future__ import annotations

from bench.gpu_checklist.helpers import fmt_ms


def _last_line(error: str) -> str:
    return error.strip().splitlines()[-1]


def _part1(p1: dict) -> list[str]:
    lines = ["", "## 1. Correctness", ""]
    k = p1.get("kernels", {})
    if "error" in k:
        lines.append(f"- kernels: ERROR {_last_line(k['error'])}")
    elif k:
        lines.append(f"- kernels ({k['triton']}): pass={k['pass']}")
        lines.append("")
        lines.append("| dtype | backend | worst err / max delta |")
        lines.append("|---|---|---|")
        for w in k["worst_rel_err"]:
            lines.append(f"| {w['dtype']} | {w['backend']} | {w['rel_err']:.2e} |")
        lines.append("")
    for key in ("engine_vs_hf_fp32", "engine_vs_hf_bf16"):
        e = p1.get(key, {})
        if "error" in e:
            lines.append(f"- {key}: ERROR {_last_line(e['error'])}")
            continue
        if not e:
            continue
        worst = max(r["max_logit_diff_before_flip"] for r in e["requests"])
        flips = [(r["request"], r["first_flip"]) for r in e["requests"] if r["first_flip"]]
        verdict = f"pass={e['pass']}" if "pass" in e else f"identical={e['identical']}"
        lines.append(
            f"- {key}: {verdict}, max |logit diff| (before any flip) {worst:.2e}, {e['new_tokens']} steps"
        )
        for rid, f in flips:
            lines.append(
                f"  - {rid}: first flip at step {f['step']} (HF top-2 gap {f['hf_top2_gap']:.3g}, "
                f"logit diff there {f['logit_diff_at_flip']:.3g})"
            )
    return lines


def _ms_cell(d) -> str:
    if not d:
        return "-"
    if "error" in d:
        return "ERR"
    return f"{d['ms']:.3f}"


def _part2(p2: dict) -> list[str]:
    bw = p2["copy_bandwidth"]["gb_s"]
    lines = ["", f"## 2. Kernel speed (bf16; copy bandwidth {bw:.0f} GB/s; Triton: {p2['triton']})", ""]
    lines.append("| h | mode | batch | k | MB | kernel ms (GB/s, % copy bw) | padded bmm ms | mm loop ms |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in p2["rows"]:
        kern = r.get("mbgmv") or r.get("mbgmm")
        kcell = (
            "-"
            if not kern
            else (
                "ERR"
                if "error" in kern
                else f"{kern['ms']:.3f} ({kern['gb_s']:.0f}, {100 * kern['share_of_copy_bw']:.0f}%)"
            )
        )
        lines.append(
            f"| {r['h']} | {r['mode']} | {r['batch']} | {r['distinct']} | {r['adapter_bytes'] / 1e6:.2f} | {kcell} | "
            f"{_ms_cell(r.get('padded_bmm'))} | {_ms_cell(r.get('torch_mm_loop'))} |"
        )
    return lines


def _part3(p3: dict) -> list[str]:
    lines = [
        "",
        "## 3. Engine speed (bf16)",
        "",
        "| batch | engine tok/s | HF tok/s | engine ÷ HF |",
        "|---|---|---|---|",
    ]
    for r in p3["base_decode"]:
        lines.append(
            f"| {r['batch']} | {r['engine_decode_tok_s']:.0f} | {r['hf_decode_tok_s']:.0f} | {r['engine_over_hf']:.2f} |"
        )
    lines += [
        "",
        "| k | MB | twin step ms | extra ms | bound ms | extra ÷ bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in p3["adapter_overhead"]:
        lines.append(
            f"| {r['k']} | {r['adapter_mb']:.0f} | {r['twin_step_ms']:.2f} | {r['extra_ms']:.2f} | "
            f"{r['bound_ms']:.3f} | {r['extra_over_bound']:.1f} |"
        )
    return lines


def _part4(p4: dict) -> list[str]:
    lines = ["", "## 4. Serving (bf16)", ""]
    for r in p4["engine"]:
        lines.append(
            f"- engine n={r['n']}: {r['tok_s']:.0f} tok/s ({r['tokens']} tokens in {r['seconds']:.1f} s, {r['steps']} steps)"
        )
    p = p4["peft"]
    lines.append(f"- PEFT: {p['tok_s']:.0f} tok/s; {p['note']}")
    ratios = [
        (k.removeprefix("engine_").replace("_over_", " ÷ "), v)
        for k, v in p4.items()
        if k.startswith("engine_n")
    ]
    lines.append("- " + "; ".join(f"{name}: {value:.2f}" for name, value in ratios))
    return lines


def markdown(result: dict) -> str:
    lines = ["# GPU checklist", ""]
    m = result["meta"]
    lines.append(
        f"- device: {m['device_name']}; torch {m['torch']}, triton {m['triton']}; model: {m['model']}"
    )
    lines.append(f"- quick: {m['quick']}; total {m['seconds']:.0f} s")
    parts = result["parts"]
    if parts.get("1"):
        lines += _part1(parts["1"])
    if parts.get("2") and "rows" in parts["2"]:
        lines += _part2(parts["2"])
    if parts.get("3") and "base_decode" in parts["3"]:
        lines += _part3(parts["3"])
    if parts.get("4") and "engine" in parts["4"]:
        lines += _part4(parts["4"])
    p5 = parts.get("5")
    if p5 and "error" not in p5:
        lines += ["", "## 5. What the work in hand adds", ""]
        lines += markdown_part5(p5)
    for key, part in parts.items():
        if "error" in part:
            lines += ["", f"## part {key}: ERROR", "", "```", part["error"].strip(), "```"]
    return "\n".join(lines)


def _structured(s: dict) -> list[str]:
    lines = [
        (
            f"- structured outputs (bf16, {s['tokenizer']} tokenizer; {len(s['schemas'])} schemas compiled in "
            f"{1e3 * s['grammar_compile_s']:.1f} ms): all outputs valid = {s['pass']}"
        ),
        "",
        (
            "| batch | tokens/request | decode step ms constrained / free (full batch) | mask cost ms/step "
            "(all / full batch) | decode time ratio | host mask compute / apply ms | parsed / schema-valid / hit max_tokens |"
        ),
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    return [*lines, *map(_structured_row, s["rows"]), ""]


def _structured_row(r: dict) -> str:
    d = r["decode_step_ms_full_batch"]
    return (
        f"| {r['batch']} | {r['tokens_per_request_mean']:.1f} | {fmt_ms(d['constrained'])} / {fmt_ms(d['free'])} "
        f"| {fmt_ms(r['mask_cost_ms_per_step'])} / {fmt_ms(r['mask_cost_ms_per_step_full_batch'])} "
        f"| {r['decode_time_ratio_constrained_over_free']:.3f} "
        f"| {fmt_ms(r['host_mask_compute_ms_full_batch'])} / {fmt_ms(r['host_mask_apply_ms_full_batch'])} "
        f"| {r['parsed']} / {r['schema_valid']} / {r['finished_by_length']} of {r['batch']} |"
    )


def _prefix_cache(pc: dict) -> list[str]:
    lines = [
        f"- prefix cache (adapters: {', '.join(pc['adapters'])}): fp32 tokens identical = {pc['pass_fp32_identical']}",
        "",
        "| dtype | system tokens | median TTFT ms cached / uncached | ratio | no shared prefix: ratio | identical | hit / missed blocks |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    lines += [_prefix_cache_row(dtype, r) for dtype, rows in pc["rows"].items() for r in rows]
    return [*lines, ""]


def _prefix_cache_row(dtype: str, r: dict) -> str:
    m = r["median_ttft_ms"]
    return (
        f"| {dtype} | {r['system_tokens']} | {fmt_ms(m['hit']['cached'])} / {fmt_ms(m['hit']['uncached'])} "
        f"| {r['ttft_ratio_cached_over_uncached']:.3f} | {r['miss_ttft_ratio_cached_over_uncached']:.3f} "
        f"| {r['identical_requests']}/{r['compared_requests']} | {r['hit_blocks']} / {r['missed_blocks']} |"
    )


def _deterministic(det: dict) -> list[str]:
    lines = []
    for mode in ("deterministic", "default"):
        m = det.get(mode, {})
        if "refused" in m:
            lines.append(f"- {mode} mode: REFUSED on this device: {m['refused']}")
        elif "error" in m:
            lines.append(f"- {mode} mode: ERROR {_last_line(m['error'])}")
        elif m:
            lines.append(
                f"- {mode} mode (bf16, batch {det['batch']}, {det['new_tokens']} tokens): {len(det['probes'])} probes "
                f"identical alone vs batched = {m['identical_alone_vs_batched']}"
                + (f" (differ: {m['differing']})" if m["differing"] else "")
                + f"; prefill {fmt_ms(m['prefill_ms'])} ms, decode step {fmt_ms(m['decode_step_ms'])} ms"
            )
    if "decode_step_ratio_deterministic_over_default" in det:
        lines.append(
            f"- deterministic ÷ default: decode step {det['decode_step_ratio_deterministic_over_default']:.2f}, "
            f"prefill {det['prefill_ratio_deterministic_over_default']:.2f}"
        )
    return lines


def _device_settings(q: dict, tp: dict) -> list[str]:
    lines = []
    if "settings" in q:
        cells = [f"{k} → {v['runs']}" if "runs" in v else f"{k}: refused" for k, v in q["settings"].items()]
        lines.append(f"- quantization on {q['device_type']}: {'; '.join(cells)}")
        refusal = next((v["refused"] for v in q["settings"].values() if "refused" in v), None)
        if refusal:
            lines.append(f"  - ({refusal})")
    if "gpus" in tp:
        lines.append(f"- tensor parallelism: not run ({tp['note']}; GPUs here: {tp['gpus']})")
    return lines


def markdown_part5(p5: dict) -> list[str]:
    lines = []
    for name, sub in p5.items():
        if isinstance(sub, dict) and "error" in sub:
            lines.append(f"- {name}: ERROR {_last_line(sub['error'])}")
    if "rows" in p5.get("structured_output", {}):
        lines += _structured(p5["structured_output"])
    if "rows" in p5.get("prefix_cache", {}):
        lines += _prefix_cache(p5["prefix_cache"])
    if "batch" in p5.get("deterministic", {}):
        lines += _deterministic(p5["deterministic"])
    lines += _device_settings(p5.get("quantization", {}), p5.get("tensor_parallel", {}))
    return lines
