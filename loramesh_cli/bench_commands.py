"""``loramesh bench``: S-LoRA's evaluation reproduced on this machine (see bench/serving);
``loramesh bench-distkv``: issue 13's DistKV-LLM long-context benchmark (see bench/distkv);
``loramesh bench-policies``: issue 15's batch policies against their seeds (see bench/policies).

The benchmarks are not part of this distribution: they are the development-only ``loramesh-bench``
(bench/pyproject.toml), imported only when a bench command runs. Raw results go to the untracked
``bench/out/<name>/`` unless ``--out`` names another folder."""

from __future__ import annotations

import shlex
from pathlib import Path

from loramesh_cli.errors import CommandError

INSTALL_BENCH = (
    "in a loramesh checkout run `make setup`, or `pip install -e ./bench` beside "
    "`pip install -e '.[reference]'`"
)


def add_parsers(sub) -> None:
    bench = _bench_parser(
        sub,
        "bench",
        "reproduce S-LoRA's evaluation here: loramesh vs PEFT and merged baselines, ablations, plots",
        out_default="bench/out/<profile>",
        profile_help="quick: ≈10 min on 2 cores; full: longer traces and every sweep point",
    )
    bench.add_argument(
        "--model", default="", help="base model: GGUF file or HF directory (default SmolLM2-135M)"
    )
    bench.add_argument("--systems", nargs="+", default=None,
                       help="run only these systems (e.g. loramesh peft merged-swap); the comparison with "
                            "llama.cpp (loramesh-up llamacpp llamacpp-base) runs only when named")  # fmt: skip
    bench.add_argument("--adapter-cache", default="", help="where the benchmark adapters are written once")
    bench.add_argument("--llama-server", default="",
                       help="llama.cpp's llama-server binary, built in its checkout (default $LORAMESH_LLAMA_SERVER)")  # fmt: skip
    bench.add_argument("--up-args", default="",
                       help='extra `loramesh up` flags of the loramesh-up system, e.g. "--dtype bfloat16"')  # fmt: skip
    bench.add_argument("--repeat", type=int, default=1,
                       help="run the selected experiments this many rounds, alternating the systems")  # fmt: skip
    bench.set_defaults(func=cmd_bench)

    distkv = _bench_parser(
        sub,
        "bench-distkv",
        "DistKV-LLM long context: 3 workers borrowing KV vs preempt, each alone, all KV local",
        out_default="bench/out/distkv[-quick]",
    )
    distkv.set_defaults(func=cmd_bench_distkv)

    policies = _bench_parser(
        sub,
        "bench-policies",
        "batch policies: dLoRA skew sweep, S-LoRA abort vs FCFS/LCFS, clustering, PetS prefill",
        out_default="bench/out/policies[-quick]",
    )
    policies.add_argument("--only", nargs="+", default=None, choices=["skew", "abort", "clustering", "pets"],
                          help="run only these experiments")  # fmt: skip
    policies.set_defaults(func=cmd_bench_policies)


def _bench_parser(
    sub,
    name: str,
    summary: str,
    out_default: str,
    profile_help: str = "quick: a smoke run; full: the figures of docs/benchmarks.md",
):
    """A bench command's parser with the ``--profile`` and ``--out`` every one takes."""
    parser = sub.add_parser(name, help=summary)
    parser.add_argument("--profile", default="quick", choices=["quick", "full"], help=profile_help)
    parser.add_argument("--out", default="", help=f"results folder (default {out_default})")
    return parser


def _profile_argv(args) -> list[str]:
    """``--profile`` and ``--out`` as given, for a bench's own ``main``."""
    return ["--profile", args.profile, *(["--out", args.out] if args.out else [])]


def bench_not_importable(error: ImportError) -> CommandError:
    """The refusal of a bench command when the ``bench`` package, or a module it needs, is not
    installed (a product install has neither)."""
    if (error.name or "").partition(".")[0] == "bench":
        return CommandError(
            f"the benchmarks are not installed (the loramesh distribution does not ship them): {INSTALL_BENCH}"
        )
    return CommandError(f"the benchmarks cannot import a module they need ({error}): {INSTALL_BENCH}")


def cmd_bench(args) -> int:
    try:
        from bench.out_dir import default_out
        from bench.serving.profiles import LLAMACPP, LLAMACPP_BASE, PEER_SYSTEMS, PROFILES, experiments
        from bench.serving.runner import DEFAULT_ADAPTER_CACHE, run_profile
        from bench.serving.system_settings import LLAMA_SERVER_ENV, SystemSettings, llama_server_path
    except ImportError as error:
        raise bench_not_importable(error) from None
    profile = PROFILES[args.profile]
    out = Path(args.out) if args.out else default_out(profile.name)
    systems = set(args.systems) if args.systems else None
    known = {e.system for e in experiments(profile)}
    if systems is not None and systems - known:
        raise CommandError(
            f"unknown system(s) {', '.join(sorted(systems - known))}; known: {', '.join(sorted(known))}"
        )
    if args.repeat < 1:
        raise CommandError(f"--repeat must be at least 1, got {args.repeat}")
    settings = SystemSettings(
        llama_server=llama_server_path(args.llama_server), up_args=tuple(shlex.split(args.up_args))
    )
    if systems and systems & {LLAMACPP, LLAMACPP_BASE} and settings.llama_server is None:
        raise CommandError(
            f"the llamacpp systems need llama-server: pass --llama-server PATH or set ${LLAMA_SERVER_ENV}"
        )
    if settings.llama_server is not None and not settings.llama_server.is_file():
        raise CommandError(f"no llama-server binary at {settings.llama_server}")
    results = run_profile(
        profile,
        out,
        model_path=args.model or None,
        adapter_cache=Path(args.adapter_cache) if args.adapter_cache else DEFAULT_ADAPTER_CACHE,
        only=lambda e: e.system in systems if systems else e.system not in PEER_SYSTEMS,
        settings=settings,
        repeat=args.repeat,
    )
    print(
        f"\n{len(results['runs'])} runs in {results['elapsed_s'] / 60:.1f} min; report: {out / 'results.md'}"
    )
    return 0


def cmd_bench_distkv(args) -> int:
    try:
        from bench.distkv.experiment import main as run_distkv
    except ImportError as error:
        raise bench_not_importable(error) from None
    return run_distkv(_profile_argv(args))


def cmd_bench_policies(args) -> int:
    try:
        from bench.policies.runner import main as run_policies
    except ImportError as error:
        raise bench_not_importable(error) from None
    return run_policies([*_profile_argv(args), *(["--only", *args.only] if args.only else [])])
