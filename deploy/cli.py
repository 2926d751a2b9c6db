"""The `pdserve` command line: plan, generate, chat, up, status, audit, loadtest, sim.

It lives with the application (deploy/), not in the library: it dispatches to the launcher
(deploy/up.py) and the load tester (loadtest/), which the library package must not import.

`plan` is pure arithmetic and runs here. `generate`, `chat` and `up` import their
handlers only when invoked, so `pdserve plan` and `--help` start without torch
(and `generate --router` and `chat` never need it).
A ValueError or FileNotFoundError from a handler is a user error: it is printed
as `error: ...` and the exit code is 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve import __version__
from pdserve.client_security import add_client_security_arguments, given_flags
from pdserve.engine.config import (
    CPU_KV_CACHE_GIB,
    KV_DTYPE_SETTINGS,
    MODEL_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from pdserve.engine.sampling_defaults import SMOLLM2_MODEL_CARD
from pdserve.units import human_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdserve.settings import Leaf, Setting


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="one of the commands below")
    _add_plan(commands)
    _add_generate(commands)
    _add_chat(commands)
    _add_up(commands)
    _add_down(commands)
    _add_status(commands)
    _add_audit(commands)
    _add_loadtest(commands)
    _add_sim(commands)
    return parser


# --- plan ---------------------------------------------------------------------------------------

def _add_plan(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "plan", help="KV cache memory for a model shape and context length",
        description="KV bytes = 2 x layers x kv_heads x (head_dim x bytes per element + scale bytes), "
                    "per token; int8 and fp8 keep a 4-byte float32 scale per token, KV head and K|V, the "
                    "float dtypes none. Give the shape with --layers/--kv-heads/--head-dim, or read it "
                    "with --model.")
    p.add_argument("--model", metavar="PATH",
                   help="read layers, KV heads and head dim from a Hugging Face model folder "
                        "(config.json), a .gguf file or a model's name (smollm2, gemma3-270m), instead of "
                        "--layers/--kv-heads/--head-dim; also prints its family and, for a model with "
                        "sliding-window layers, what their KV would be if only the window were kept")
    p.add_argument("--layers", type=int, help="number of decoder layers (config.json: num_hidden_layers)")
    p.add_argument("--kv-heads", type=int,
                   help="number of key/value heads (config.json: num_key_value_heads; "
                        "fewer than attention heads under grouped-query attention)")
    p.add_argument("--head-dim", type=int, help="dimension of one attention head, e.g. 128")
    p.add_argument("--dtype", choices=KV_DTYPE_SETTINGS, default=CacheConfig().kv_dtype,
                   help="element type of the KV cache; int8 and fp8 count their scales (default: "
                        "%(default)s, the engine's default: the model's dtype, so bfloat16 with "
                        "--gpu-memory-gib and float32 without)")
    p.add_argument("--model-dtype", choices=MODEL_DTYPES, default=EngineConfig().dtype,
                   help="the weights' dtype, the engine's --dtype (default: %(default)s: bfloat16 on a GPU, "
                        "--gpu-memory-gib, else float32 as on the CPU)")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence (prompt + output)")
    p.add_argument("--sequences", type=int, default=1,
                   help="sequences held at once (default: %(default)s)")
    p.add_argument("--memory-gib", type=float,
                   help="memory budget for the KV cache in GiB; adds how many sequences and tokens fit")
    p.add_argument("--host-gib", type=float,
                   help="a host-memory KV tier of this many GiB (pdserve up --host-cache-gib); adds the "
                        "tokens it holds")
    p.add_argument("--disk-gib", type=float,
                   help="a disk KV tier of this many GiB (--disk-cache-gib); adds the tokens it holds")
    p.add_argument("--gpu-memory-gib", type=float, metavar="GIB",
                   help="plan for a worker on a GPU of this much memory (with --model): the pool it sizes "
                        "itself by --gpu-memory-utilization, what is left after the weights and an "
                        "activation reserve, in blocks; the dtypes' auto is then a GPU's (bfloat16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig().gpu_memory_utilization,
                   metavar="FRACTION", help="with --gpu-memory-gib: the share of the GPU a worker may use "
                                            "(default: %(default)s, the engine's)")
    p.add_argument("--block-size", type=int, default=CacheConfig().block_size,
                   help="with --gpu-memory-gib: tokens per KV block (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from pdserve.engine.config import resolve_kv_dtype, resolve_model_dtype
    from pdserve.plan import plan_for_model, plan_gpu_pool, plan_kv

    shape_flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    family = gpu = None
    # NOTE: the engine's resolution (pdserve/engine/config.py): a GPU plan is cuda's, the rest the CPU's
    device = "cuda" if args.gpu_memory_gib is not None else "cpu"
    model_dtype = resolve_model_dtype(args.model_dtype, device)
    kv_dtype = resolve_kv_dtype(args.dtype, model_dtype.value)
    args.dtype = kv_dtype.value
    if args.gpu_memory_gib is not None and args.model is None:
        raise ValueError("--gpu-memory-gib needs --model: the pool is what the weights and activations leave")
    if args.model is not None:
        given = [flag for flag, value in shape_flags.items() if value is not None]
        if given:
            raise ValueError(f"--model sets the shape; drop {', '.join(given)} or drop --model")
        from pdserve.engine.named_models import resolve_model_path
        from pdserve.window_plan import family_plan, read_model_config

        path = resolve_model_path(args.model)
        plan = plan_for_model(path, args.dtype, args.tokens, args.sequences, args.memory_gib,
                              args.host_gib, args.disk_gib)
        config = read_model_config(path)
        family = family_plan(config, args.dtype, args.tokens)
        if args.gpu_memory_gib is not None:
            scheduler = SchedulerConfig()
            gpu = plan_gpu_pool(config, plan.weights, args.dtype, model_dtype.value, args.gpu_memory_gib,
                                args.gpu_memory_utilization, args.block_size,
                                scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    else:
        missing = [flag for flag, value in shape_flags.items() if value is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}: give the model shape, or --model PATH to read it")
        plan = plan_kv(args.layers, args.kv_heads, args.head_dim, args.dtype,
                       args.tokens, args.sequences, args.memory_gib, args.host_gib, args.disk_gib)

    if args.json:
        extra = (family.as_dict() if family is not None else {}) | (gpu.as_dict() if gpu is not None else {})
        print(json.dumps(plan.as_dict() | extra))
        return 0
    for line in family.describe() if family is not None else ():
        print(line)
    s = plan.shape
    print(f"KV cache: {s.num_layers} layers x {s.num_kv_heads} KV heads x head_dim {s.head_dim}, "
          f"{plan.dtype}; {model_dtype.describe()}, {kv_dtype.describe()}")
    scales = f"{plan.scale_bytes_per_token:,} B of them scales" if plan.scale_bytes_per_token else ""
    rows = [
        ("per token", plan.bytes_per_token, scales),
        ("per sequence", plan.bytes_per_sequence, f"{plan.tokens:,} tokens"),
        ("total", plan.bytes_total, f"{plan.sequences:,} x {plan.tokens:,} tokens"),
    ]
    for label, nbytes, note in rows:
        print(f"  {label:<13}{nbytes:>18,} B  {human_bytes(nbytes, decimals=2):>11}  {note}".rstrip())
    if plan.memory_gib is not None:
        verdict = "fits" if plan.sequences_that_fit >= plan.sequences else "does NOT fit"
        print(f"  in {plan.memory_gib:g} GiB: {plan.sequences_that_fit:,} sequences of "
              f"{plan.tokens:,} tokens ({plan.tokens_that_fit:,} tokens in all); the total {verdict}")
    for tier, gib, fit in (("host", plan.host_gib, plan.host_tokens_that_fit),
                           ("disk", plan.disk_gib, plan.disk_tokens_that_fit)):
        if gib is not None:
            print(f"  {tier} tier of {gib:g} GiB: {fit:,} tokens of evicted prefixes, loaded back on a hit")
    if plan.weights is not None and gpu is None:
        print(f"weights: {plan.weights.describe()}")
    if gpu is not None:
        print(f"GPU pool: {gpu.describe()}")
    return 0


# --- generate -----------------------------------------------------------------------------------

def _add_generate(commands: argparse._SubParsersAction) -> None:
    cache, sched = CacheConfig(), SchedulerConfig()
    p = commands.add_parser(
        "generate", help="generate text for a prompt, in-process (--local) or through a router",
        description="Generate a completion. The prompt goes through the model's chat template "
                    "unless --raw or --token-ids is given.")
    p.add_argument("prompt", nargs="?", help="the user message (omit when using --token-ids or --input)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="run the engine in this process (the default when --router is not given)")
    where.add_argument("--router", metavar="HOST:PORT[,HOST:PORT...]",
                       help="send the request to a running pdserve router (e.g. 127.0.0.1:50051, "
                            "as started by `pdserve up`) instead of running the engine here; several "
                            "routers, comma-separated, are tried in turn when one is unavailable")
    p.add_argument("--model", metavar="PATH",
                   help="model for --local: a Hugging Face folder, a .gguf file or a model's name "
                        "(smollm2, gemma3-270m) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt text as is, without the chat template")
    p.add_argument("--token-ids", metavar="1,2,3",
                   help="send these comma-separated token ids as the prompt, skipping the tokenizer "
                        "and chat template")
    p.add_argument("--system", metavar="TEXT", help="system message for the chat template")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature; 0 means greedy (default: the model's, as in vLLM: its "
                        f"generation_config.json, {SMOLLM2_MODEL_CARD.temperature:g} for the embedded "
                        "SmolLM2 (its model card's), else 1.0; with --router, the router's)")
    p.add_argument("--top-k", type=int,
                   help="sample only from the k most likely tokens; 0 turns it off (default: the model's, "
                        "else 0)")
    p.add_argument("--top-p", type=float,
                   help="sample from the smallest set of tokens whose probability reaches p; "
                        f"1.0 turns it off (default: the model's: {SMOLLM2_MODEL_CARD.top_p:g} for the "
                        "embedded SmolLM2, else 1.0)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT; repeat for several stop strings")
    p.add_argument("--block-size", type=int, default=cache.block_size,
                   help="tokens per KV cache block for --local (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_SETTINGS, default=cache.kv_dtype,
                   help="KV cache element type for --local; auto = the model's dtype; int8 and fp8 quantize "
                        "K/V per token and KV head (default: %(default)s)")
    p.add_argument("--num-blocks", type=int,
                   help=f"KV cache blocks for --local (default: as many as {CPU_KV_CACHE_GIB:g} GiB holds on "
                        "the CPU; on CUDA what 0.9 of the GPU leaves)")
    p.add_argument("--max-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                   help="token budget per engine step, which sets the prefill chunk size "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per request (text, token ids, finish reason, usage) "
                        "instead of streaming text")
    p.add_argument("--input", metavar="FILE.jsonl",
                   help="read requests from a JSON Lines file, one request object per line")
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    add_client_security_arguments(p)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    if args.router:
        from pdserve.remote_cli import run_remote_generate

        return run_remote_generate(args)
    security_flags = given_flags(args)
    if security_flags:
        raise ValueError(f"{', '.join(security_flags)} apply to --router only: --local runs the engine "
                         "in this process, with no connection to secure")
    from pdserve.generate_cli import run_generate

    return run_generate(args)


# --- chat ---------------------------------------------------------------------------------------

def _add_chat(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "chat", help="interactive multi-turn chat through a running router",
        description="Chat with the model behind a pdserve router. Each turn sends the whole "
                    "conversation, so the router can reuse the KV cache of the turns before. Type "
                    "/reset to clear the history, /exit (or Ctrl-D) to quit. Reads stdin line by "
                    "line, so it also works with piped input.")
    p.add_argument("--router", metavar="HOST:PORT[,HOST:PORT...]", default="127.0.0.1:50051",
                   help="address of a running pdserve router, or several comma-separated (each turn goes "
                        "to one, round robin; one that is unavailable is skipped) (default: %(default)s, "
                        "`pdserve up`'s)")
    p.add_argument("--system", metavar="TEXT", help="system message that opens the conversation")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature; 0 means greedy (default: the router's, which is the served "
                        "model's; `pdserve up` prints it)")
    p.add_argument("--top-k", type=int,
                   help="sample only from the k most likely tokens; 0 = off (default: the router's)")
    p.add_argument("--top-p", type=float,
                   help="sample from the smallest set of tokens whose probability reaches p; 1.0 = off "
                        "(default: the router's)")
    p.add_argument("--seed", type=int, help="random seed, for reproducible sampling")
    p.add_argument("--max-tokens", type=int,
                   help="most tokens per reply (default: the router's, 128)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a reply when it contains TEXT; repeat for several stop strings")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="deadline for each reply (default: %(default)s)")
    add_client_security_arguments(p)
    p.set_defaults(handler=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from pdserve.remote_cli import run_chat

    return run_chat(args)


# --- up -----------------------------------------------------------------------------------------

def _add_up(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "up", help="start a cluster: Redis, Ray (local or joined), workers, router",
        description="Start Redis (embedded unless --redis-url), Ray (local unless --address), "
                    "prefill and decode worker actors and the router; answer one sample chat; "
                    "serve until Ctrl-C or SIGTERM, then tear everything down. A --config file "
                    "gives the topology (see deploy/examples/); flags given here override it. Each "
                    "flag below names its key in the file.")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="topology file: model, workers and their Ray resources, actor placement, cache, "
                        "router, Redis, Ray address (default: none; the defaults below)")
    _add_up_settings(p)
    p.add_argument("--no-sample", action="store_true",
                   help="do not answer the sample chat after start-up")
    p.add_argument("--detach", action="store_true",
                   help="run every router, worker and the embedded Redis as a detached Ray actor (on a Ray "
                        "head of the cluster's own unless --address), print the routers and how to stop "
                        "them, and exit: the cluster outlives this command; `pdserve down` stops it "
                        "(deploy/detached.py)")
    p.set_defaults(handler=_run_up)


def _add_up_settings(p: argparse.ArgumentParser) -> None:
    """One flag per setting of ClusterSpec and its parts, built from the fields' declarations
    (pdserve/settings.py); each part's flags are a group, described by its docstring. A flag not given
    is absent from the namespace, so the file (or the default) decides."""
    from deploy.config import ClusterSpec, flag_settings
    from pdserve.settings import parts

    groups = {path: p.add_argument_group(_group_title(path, part), _first_paragraph(part.__doc__))
              for path, part in parts(ClusterSpec)}
    for leaf in flag_settings():
        group = groups[leaf.path.rpartition(".")[0]]
        s = leaf.setting
        kwargs: dict = dict(dest=leaf.path, default=argparse.SUPPRESS, help=_flag_help(leaf))
        if leaf.scalar_type() is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _flag_type(leaf)
            kwargs["metavar"] = s.metavar or _default_metavar(s)
        group.add_argument(s.flag, **kwargs)
        if s.renamed_from:
            group.add_argument(s.renamed_from[1], action=_RenamedFlag, renamed_to=s.flag)


def _default_metavar(s: Setting) -> str:
    """{a,b,c} for a setting with choices, else the flag's name: --block-size BLOCK_SIZE."""
    if s.choices:
        return "{" + ",".join(s.choices) + "}"
    return s.flag.removeprefix("--").replace("-", "_").upper()


def _group_title(path: str, part: type) -> str:
    return f"{part.__name__} ({path})" if path else part.__name__


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _flag_help(leaf: Leaf) -> str:
    s = leaf.setting
    text = s.help
    if "(default:" not in text:
        text += f" (default: {_shown(leaf.default)})"
    if s.key:
        text += f" [file: {s.key}]"
    return text.replace("%", "%%")


def _shown(default: object) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default is None else str(default)


def _flag_type(leaf: Leaf) -> Callable[[str], object]:
    """The flag's text as the field's type; `none` for an optional number (a file's null)."""
    convert = leaf.scalar_type()
    if not leaf.optional or convert is str:
        return convert

    def optional(text: str) -> object:
        return None if text.lower() == "none" else convert(text)

    optional.__name__ = convert.__name__  # argparse names it in "invalid int value"
    return optional


class _RenamedFlag(argparse.Action):
    """A flag that was renamed: using it is a usage error naming the new one, not a second name."""

    def __init__(self, option_strings: Sequence[str], dest: str, renamed_to: str = "", **_: object) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.renamed_to = renamed_to

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.renamed_to}")


def _run_up(args: argparse.Namespace) -> int:
    from deploy.up import run_up

    return run_up(args)


# --- down ---------------------------------------------------------------------------------------

def _add_down(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "down", help="stop a cluster started with `pdserve up --detach`",
        description="Stop everything `pdserve up --detach` started: its routers, workers and embedded Redis "
                    "(gracefully, then killed) and the Ray head it started, if it started one. Name the "
                    "cluster by any of its routers, or by its Ray namespace and address.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--router", metavar="HOST:PORT",
                       help="any router of the cluster: it names its Ray address and namespace")
    which.add_argument("--namespace", metavar="NAME",
                       help="the cluster's Ray namespace (`pdserve up --namespace`), with --address")
    p.add_argument("--address", metavar="HOST:PORT",
                   help="with --namespace: the Ray address `pdserve up --detach` printed, or `auto`")
    add_client_security_arguments(p)
    p.set_defaults(handler=_run_down)


def _run_down(args: argparse.Namespace) -> int:
    from deploy.detached import run_down

    return run_down(args)


# --- status -------------------------------------------------------------------------------------

def _add_status(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "status", help="one table of the running cluster: workers, role, node, state, queue, KV use",
        description="Ask the router (its Admin ClusterStatus call) for every worker it knows and print "
                    "role, node, state, queue (waiting/running), KV blocks used, prefix hit rate "
                    "(cached / prompt tokens), KV bytes sent and received, and failed transfers.")
    p.add_argument("--router", metavar="HOST:PORT", default="127.0.0.1:50051",
                   help="the router's gRPC address (default: %(default)s, what `pdserve up` uses)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON instead of a table")
    p.add_argument("--watch", type=float, metavar="SECONDS",
                   help="print again every SECONDS until Ctrl-C (default: print once)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="deadline for the status call (default: %(default)s)")
    add_client_security_arguments(p)
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from pdserve.status_cli import run_status

    try:
        return run_status(args)
    except KeyboardInterrupt:
        return 0


# --- audit --------------------------------------------------------------------------------------

def _add_audit(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "audit", help="recompute cached KV blocks on every worker and compare; evict what differs",
        description="Ask the router (its Admin AuditCluster call) to audit every worker's KV cache: each "
                    "worker recomputes cached blocks from their token prefix and compares them with the "
                    "stored bytes (bit-exact, else within a stated tolerance for its KV dtype); a block "
                    "that differs is evicted and unpublished from the prefix index. Prints one row per "
                    "worker: blocks cached, checked, bit-exact, mismatched, evicted, skipped, the worst "
                    "relative difference, and time taken.",
        epilog="exit status: 0 every worker audited and nothing mismatched; 1 a mismatch was found; "
               "2 a usage error; 3 nothing mismatched, but the router or a worker did not answer, or an "
               "audit ran out of time before checking everything.")
    p.add_argument("--router", metavar="HOST:PORT", default="127.0.0.1:50051",
                   help="the router's gRPC address (default: %(default)s, what `pdserve up` uses)")
    p.add_argument("--sample", type=int, default=0, metavar="N",
                   help="per worker, audit N cached blocks chosen at random, each with its cached "
                        "ancestors (one recompute covers them); 0 = every cached block "
                        "(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="deadline for the whole audit; a worker stops starting recomputes near it and "
                        "reports what it checked (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the raw reply as JSON instead of a table")
    add_client_security_arguments(p)
    p.set_defaults(handler=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    if args.sample < 0:
        raise ValueError(f"--sample must be >= 0 (0 = every cached block), got {args.sample}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    from pdserve.audit_cli import run_audit

    return run_audit(args)


# --- loadtest -----------------------------------------------------------------------------------

def _add_loadtest(commands: argparse._SubParsersAction) -> None:
    # NOTE: loadtest.cli imports only argparse and its pure workloads here; grpc and
    # matplotlib load when a run starts, so `pdserve --help` stays fast.
    from loadtest.cli import add_parser

    add_parser(commands)


# --- sim ----------------------------------------------------------------------------------------

def _add_sim(commands: argparse._SubParsersAction) -> None:
    # NOTE: sim.cli imports only argparse and pure modules here; torch loads only for `sim calibrate`.
    from sim.cli import add_parser

    add_parser(commands)


if __name__ == "__main__":
    sys.exit(main())
