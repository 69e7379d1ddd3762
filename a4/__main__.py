"""The command line: `python -m a4 demo | generate | serve | bench`.

- `demo`: a batch of requests with shared prefixes through the engine (chunked prefill and the prefix cache at work),
  each request's output beside transformers' greedy output; exits non-zero if any request differs. By default the
  trained tiny Qwen3.5 (a4/trained/qwen3_5-tiny, `python -m a4.train_tiny`), whose prompts and answers are text:
  chats in Qwen's template and a story to continue. `--arch qwen3` / `qwen3_5_moe` build random-weight tiny
  checkpoints, whose requests are random token ids. While Qwen3.5 still meets an exercise that is not written, the
  default shows what already works (Qwen3) and names that exercise.
- `generate`: continue prompts given as token ids (`--prompt "1 2 3"`) or as text (`--text`, when the checkpoint
  directory has a tokenizer; `--chat` wraps each text in the chat template as a user's message). The checkpoint is
  the trained tiny Qwen3.5 unless `--model-dir` names another.
- `serve`: an OpenAI-compatible HTTP server (a4/server) over the engine, whose options are its flags; by default
  the trained tiny Qwen3.5 and its tokenizer.
- `bench <name>`: run a benchmark module of `a4.bench` (all of them without a name; those that cannot run on this
  machine, as `bench gpu` without CUDA, are skipped, and fail only when named).

Bad arguments give one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pkgutil
import random
import re
import sys
from pathlib import Path

from a4.core import Output, SamplingParams
from a4.course.exercises import not_written_yet, stubs, unwritten_exercise
from a4.dtypes import DTYPES
from a4.engine.config import HYBRID_PREFIX_POLICIES
from a4.models.weights import LOAD_FORMATS
from a4.tiny_corpus import SYSTEM_PROMPT

ARCHS = ("qwen3", "qwen3_5", "qwen3_5_moe")
DEFAULT_ARCH = "qwen3_5"
DEMO_TEXT_TOKENS = 48  # an answer, or a few sentences of a story
DEMO_ID_TOKENS = 8
DEFAULT_BENCH_OUT = Path("bench-out")
# Options of one benchmark only: the option's name -> the benchmark that takes it.
BENCH_OPTIONS = {
    "system": "gpu", "parts_dir": "gpu", "commit": "gpu", "model_dir": "serve", "device": "serve", "base_url": "serve"
}
USAGE_ERROR = 2


class UsageError(Exception):
    """A bad command-line argument: reported in one line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError) as e:
        # ValueError covers what the engine rejects: bad settings, a malformed config.json (ConfigError).
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m a4", description="a4: a small SGLang-style inference engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,generate,serve,bench}")

    demo = commands.add_parser("demo", help="engine vs transformers on a batch with shared prefixes")
    demo.add_argument(
        "--arch", choices=ARCHS, help="tiny checkpoint to build (default: qwen3_5, or qwen3 while it needs exercises)"
    )
    demo.add_argument("--model-dir", type=Path, help="a local checkpoint instead of the tiny one")
    demo.add_argument("--dtype", choices=DTYPES, default="float32")
    demo.add_argument("--device", default="cpu")
    demo.add_argument(
        "--max-new-tokens", type=positive_int, help=f"default: {DEMO_TEXT_TOKENS} for text, {DEMO_ID_TOKENS} for ids"
    )
    demo.add_argument("--max-prefill-tokens", type=positive_int, default=16, help="small, so that prompts are chunked")
    demo.add_argument("--max-running-requests", type=positive_int, default=4)
    demo.add_argument("--page-size", type=positive_int, default=1)
    demo.set_defaults(run=run_demo)

    generate = commands.add_parser("generate", help="continue prompts")
    generate.add_argument("--model-dir", type=Path, help="a checkpoint (default: the trained tiny Qwen3.5)")
    prompts = generate.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", type=token_ids, help='token ids, e.g. "1 2 3" (repeatable)')
    prompts.add_argument("--text", action="append", help="text, tokenized by the checkpoint's tokenizer (repeatable)")
    generate.add_argument("--chat", action="store_true", help="--text as a user's message in the chat template")
    generate.add_argument("--max-new-tokens", type=positive_int, default=16)
    generate.add_argument("--dtype", choices=DTYPES, default="float32")
    generate.add_argument("--device", default="cpu")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    serve.add_argument(
        "--model-dir", type=Path, help="a checkpoint with a tokenizer (default: the trained tiny Qwen3.5)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (uvicorn's log line names it)")
    serve.add_argument("--served-model-name", help="the model's name in the API (default: the directory's name)")
    serve.add_argument(
        "--max-queued-requests", type=non_negative_int, default=argparse.SUPPRESS,
        help="requests that may wait beyond the running ones; past them the server answers 503 (default: "
        "DEFAULT_MAX_QUEUED_REQUESTS in a4/server/launch.py)",
    )
    serve.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on the /v1/ routes (default: the A4_API_KEY "
        "environment variable, if set; a flag shows in the process list, the variable does not)",
    )
    serve.add_argument(
        "--max-request-bytes", type=positive_int, default=argparse.SUPPRESS,
        help="larger request bodies get 413 at once (default: DEFAULT_MAX_REQUEST_BYTES in a4/server/limits.py)",
    )
    serve.add_argument(
        "--timeout-request", type=positive_float, dest="request_timeout", default=argparse.SUPPRESS,
        help="seconds a request may take to arrive: its headers, then its body; slower ones are dropped (default: "
        "DEFAULT_REQUEST_TIMEOUT in a4/server/limits.py)",
    )
    serve.add_argument(
        "--enable-special-tokens-in-messages", action="store_true", default=argparse.SUPPRESS,
        help="read special-token text in chat messages as special tokens (transformers' behaviour: a user can then "
        "forge turns of other roles); by default it is plain text",
    )
    add_engine_options(serve)
    serve.set_defaults(run=run_serve)

    bench = commands.add_parser("bench", help="run a benchmark of a4.bench (all of them without a name)")
    bench.add_argument("name", nargs="?", help=f"one of: {', '.join(benchmark_names()) or '(none yet)'}")
    bench.add_argument("--quick", action="store_true", help="a smaller run")
    bench.add_argument(
        "--out", type=Path, help=f"output directory (default: {DEFAULT_BENCH_OUT}; bench gpu: solutions/report)"
    )
    bench.add_argument("--system", help="bench gpu only: measure this one part in this process (as it runs each)")
    bench.add_argument(
        "--parts-dir", type=Path, help="bench gpu only: keep each part's JSON here, reusing those already here"
    )
    bench.add_argument(
        "--commit", type=commit_hash,
        help="bench gpu only: the commit the report names, where the tree's own .git is not its history (a copy sent "
        "to a lent GPU); default: HEAD, marked +changes when tracked files differ",
    )
    bench.add_argument("--model-dir", type=Path, help="bench serve only: the checkpoint to serve (with a tokenizer)")
    bench.add_argument("--device", help="bench serve only: the server's device (cpu, cuda)")
    bench.add_argument("--base-url", help="bench serve only: a running server to measure instead of starting one")
    bench.set_defaults(run=run_bench)
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def commit_hash(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{4,40}", text):
        raise argparse.ArgumentTypeError(f"expected a commit's hash (4 to 40 hex digits, as git prints it): {text!r}")
    return text


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as flags. An option not given is not passed on, so EngineConfig's defaults apply (and
    EngineConfig checks the values given)."""
    engine = parser.add_argument_group("engine options (EngineConfig's fields)")
    flag = {"default": argparse.SUPPRESS}
    engine.add_argument("--dtype", choices=DTYPES, **flag)
    engine.add_argument("--device", **flag)
    engine.add_argument("--max-running-requests", type=positive_int, **flag)
    engine.add_argument("--max-prefill-tokens", type=positive_int, **flag)
    engine.add_argument("--page-size", type=positive_int, **flag)
    engine.add_argument("--enable-prefix-cache", action=argparse.BooleanOptionalAction, **flag)
    engine.add_argument("--memory-budget-bytes", type=positive_int, **flag)
    engine.add_argument("--state-fraction", type=float, **flag)
    engine.add_argument("--hybrid-prefix-policy", choices=HYBRID_PREFIX_POLICIES, **flag)
    engine.add_argument("--max-state-checkpoints", type=non_negative_int, **flag)
    engine.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, **flag)
    engine.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, **flag)
    engine.add_argument("--speculative-tokens", type=non_negative_int, **flag)
    engine.add_argument("--tensor-parallel-size", type=positive_int, **flag)
    engine.add_argument("--load-format", choices=LOAD_FORMATS, **flag)
    engine.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, **flag)
    engine.add_argument("--enable-mixed-chunk", action=argparse.BooleanOptionalAction, **flag)


def token_ids(text: str) -> list[int]:
    try:
        return [int(token) for token in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by spaces, got {text!r}") from None


def model_dir_or_fail(path: Path) -> Path:
    if not path.is_dir():
        raise UsageError(f"--model-dir {path}: no such directory")
    return path


# -------------------------------------------------------------------------------------------------------------- demo


def demo_prompts(vocab_size: int, stop_tokens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Eight prompts of 1 to 70 tokens; six share a 24-token "system prompt", one repeats another exactly."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        out = []
        while len(out) < n:
            token = rng.randrange(vocab_size)
            if token not in stop_tokens:
                out.append(token)
        return out

    system = tokens(24)
    questions = [system + tokens(n) for n in (3, 11, 29, 6)]
    return [
        *questions,
        tokens(70),  # unrelated, and longer than the prefill budget: chunked
        tokens(1),
        questions[0],  # the same prompt again: all but its last token comes from the cache
        questions[1] + tokens(5),  # extends another request's prompt
    ]


def run_demo(args: argparse.Namespace) -> int:
    if args.arch is not None or args.model_dir is not None:
        try:
            return demo(args, args.arch or DEFAULT_ARCH)
        except NotImplementedError as e:
            print(f"error: {not_written_yet(str(e))}", file=sys.stderr)
            return 1
    try:
        return demo(args, DEFAULT_ARCH)
    except NotImplementedError as e:
        if (missing := unwritten_exercise(e)) is None:
            raise
    # A student's handout: show what already works, then what to write.
    print(f"\nQwen3.5 cannot run yet: {not_written_yet(missing)}")
    print("Meanwhile, the engine serving the all-attention Qwen3, which needs no exercise:\n", flush=True)
    status = demo(args, "qwen3")
    left = stubs()
    print(f"\nQwen3.5 cannot run yet: {not_written_yet(missing)}")
    if left:
        first = left[0]
        print(f"The first exercise to write, in notebook order: {first.id} in {first.where} ({first.text}; "
              f"notebooks/{first.notebook}.ipynb)")
    print(f"`python -m a4.course list` shows the {len(left)} exercises still to write.")
    return status


DEMO_SYSTEM = {"role": "system", "content": SYSTEM_PROMPT}  # the one the trained model saw
DEMO_CHATS = (
    [DEMO_SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    [DEMO_SYSTEM, {"role": "user", "content": "What is 7 plus 5?"}],
    [DEMO_SYSTEM, {"role": "user", "content": "What sound does a cow make?"}],
    [DEMO_SYSTEM, {"role": "user", "content": "Tell me a story about a fox."}],
    [{"role": "user", "content": "Hello!"}],
)
DEMO_STORY = "Once upon a time, there was a brave little owl named Ada. Ada lived in a stone castle near the sea."


def demo_texts(tokenizer) -> list[str]:
    """Eight text prompts: four chats share a system prompt, one repeats another exactly, one continues another's
    conversation, and a story to continue is longer than the demo's prefill budget (chunked)."""
    def chat(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    follow_up = [
        *DEMO_CHATS[1], {"role": "assistant", "content": "7 plus 5 is 12."}, {"role": "user", "content": "Thanks!"}
    ]
    return [*map(chat, DEMO_CHATS), DEMO_STORY, chat(DEMO_CHATS[0]), chat(follow_up)]


def demo(args: argparse.Namespace, arch: str) -> int:
    from a4.checkpoints import tiny_checkpoint
    from a4.llm import LLM
    from a4.reference import hf_greedy

    if args.model_dir is not None:
        model_dir = model_dir_or_fail(args.model_dir)
    elif arch == "qwen3_5":
        model_dir = tiny_checkpoint(arch, trained=True)
        print(f"the trained tiny Qwen3.5 ({model_dir}; written by `python -m a4.train_tiny`)", flush=True)
    else:
        print(f"building (or reusing) the tiny {arch} checkpoint (random weights) ...", flush=True)
        model_dir = tiny_checkpoint(arch)
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        page_size=args.page_size,
    )
    config = llm.engine.model_config
    tokenizer = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
    if tokenizer is None:
        prompts = demo_prompts(config.vocab_size, config.eos_token_ids)
        max_new_tokens = args.max_new_tokens or DEMO_ID_TOKENS
    else:
        prompts = [tokenizer.encode(text) for text in demo_texts(tokenizer)]
        max_new_tokens = args.max_new_tokens or DEMO_TEXT_TOKENS
    print(f"model: {config.architecture} from {model_dir} ({args.dtype} on {args.device})")
    print(
        f"{len(prompts)} requests, up to {max_new_tokens} new tokens each; max_prefill_tokens="
        f"{args.max_prefill_tokens}, max_running_requests={args.max_running_requests}, page_size={args.page_size}, "
        f"prefix cache {'on' if llm.engine.prefix_cache_enabled else 'off'}\n"
    )
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    print("running transformers (each prompt alone) for reference ...\n", flush=True)
    expected = hf_greedy(model_dir, prompts, max_new_tokens, dtype=args.dtype)

    matches = [out.token_ids == ref for out, ref in zip(outputs, expected)]
    if tokenizer is None:
        print_comparison(prompts, outputs, expected, matches)
    else:
        print_text_comparison(tokenizer, prompts, outputs, expected, matches)
    print("\nmemory plan")
    print("  " + llm.memory_plan.describe().replace("\n", "\n  "))
    stats = llm.stats
    prompt_tokens = sum(len(p) for p in prompts)
    print(
        f"\nprefix cache: {stats.cached_tokens} of {prompt_tokens} prompt tokens served from the cache "
        f"({stats.cached_tokens / prompt_tokens:.0%}), {sum(o.cached_tokens > 0 for o in outputs)} requests hit"
    )
    print(
        f"steps: {stats.prefill_steps} prefill ({stats.prefill_tokens} tokens, "
        f"{stats.prefill_tokens_per_second:,.0f} tok/s), {stats.decode_steps} decode ({stats.decode_tokens} tokens, "
        f"{stats.decode_tokens_per_second:,.0f} tok/s)"
    )
    if all(matches):
        print(f"\nall {len(prompts)} requests match transformers token for token")
        return 0
    print(f"\nMISMATCH: {matches.count(False)} of {len(prompts)} requests differ from transformers")
    return 1


def print_comparison(
    prompts: list[list[int]], outputs: list[Output], expected: list[list[int]], matches: list[bool]
) -> None:
    a4_column = [" ".join(map(str, out.token_ids)) for out in outputs]
    hf_column = [" ".join(map(str, ref)) for ref in expected]
    width = max(len("a4 tokens"), *(len(text) for text in a4_column + hf_column))
    print(f"{'req':>3} {'prompt':>6} {'cached':>6}  {'a4 tokens':<{width}}  {'transformers':<{width}}  match")
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(
            f"{i:>3} {len(prompt):>6} {out.cached_tokens:>6}  {a4_column[i]:<{width}}  {hf_column[i]:<{width}}  "
            f"{'yes' if matches[i] else 'NO'}"
        )


def print_text_comparison(
    tokenizer, prompts: list[list[int]], outputs: list[Output], expected: list[list[int]], matches: list[bool]
) -> None:
    """A line per request (prompt and cached tokens, match), then its prompt and both answers as text; special
    tokens are shown, so that the chat template and where each answer stopped can be read."""
    print(f"{'req':>3} {'prompt':>6} {'cached':>6}  match")
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, expected)):
        print(f"{i:>3} {len(prompt):>6} {out.cached_tokens:>6}  {'yes' if matches[i] else 'NO'}")
        for label, ids in (("prompt", prompt), ("a4", out.token_ids), ("transformers", ref)):
            print(f"      {label:<13} {tokenizer.decode(ids)!r}")


# ---------------------------------------------------------------------------------------------------------- generate


def run_generate(args: argparse.Namespace) -> int:
    from a4.llm import LLM

    from a4.checkpoints import tiny_checkpoint

    if args.chat and not args.text:
        raise UsageError("--chat applies to --text prompts")
    if args.model_dir is None:
        model_dir = tiny_checkpoint("qwen3_5", trained=True)
    else:
        model_dir = model_dir_or_fail(args.model_dir)
    tokenizer = load_tokenizer(model_dir) if args.text else None
    texts = [chat_text(tokenizer, text) for text in args.text] if args.chat else args.text
    prompts = [tokenizer.encode(text) for text in texts] if tokenizer else args.prompt
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed,
    )
    llm = LLM(model_dir, dtype=args.dtype, device=args.device)
    failed = False
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, params))):
        if out.finish_reason == "error":
            print(f"[{i}] error: {out.error}")
            failed = True
            continue
        print(f"[{i}] {' '.join(map(str, out.token_ids))}  ({out.finish_reason})")
        if tokenizer is not None:
            print(f"    {tokenizer.decode(prompt)!r} -> {tokenizer.decode(out.token_ids)!r}")
    return 1 if failed else 0


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).exists() for name in TOKENIZER_FILES)


def chat_text(tokenizer, text: str) -> str:
    """`text` as a user's message in the tokenizer's chat template, up to where the assistant's answer begins."""
    if not tokenizer.chat_template:
        raise UsageError("--chat needs a tokenizer with a chat template, and this one has none")
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(model_dir: Path, needed_by: str = "--text", alternative: str = "use --prompt"):
    from transformers import AutoTokenizer

    # Checked first: without any tokenizer file, transformers 5 quietly builds an empty tokenizer from the model
    # type, which would turn every text into an empty prompt.
    if not has_tokenizer(model_dir):
        raise UsageError(
            f"{needed_by} needs a tokenizer, and {model_dir} has none ({', '.join(TOKENIZER_FILES)}); {alternative}"
        )
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"{needed_by} needs a tokenizer, and the one in {model_dir} does not load ({e})") from None


# ------------------------------------------------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    from a4.llm import OPTIONS
    from a4.server.auth import API_KEY_ENV
    from a4.server.launch import build_app, default_model_dir, run_server

    model_dir = model_dir_or_fail(args.model_dir) if args.model_dir is not None else default_model_dir()
    tokenizer = load_tokenizer(model_dir, "serve", "give --model-dir a checkpoint with its tokenizer files")
    # The flags given, and only those: the defaults are build_app's and EngineConfig's.
    server_options = ("max_queued_requests", "max_request_bytes", "request_timeout",
                      "enable_special_tokens_in_messages")  # fmt: skip
    options = {name: getattr(args, name) for name in (*OPTIONS, *server_options) if hasattr(args, name)}
    # An empty variable is no key (as if unset); an empty flag is a mistake, which build_app names.
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    app = build_app(model_dir, tokenizer, served_model_name=args.served_model_name, api_key=api_key, **options)
    print(f"serving {model_dir} (uvicorn names the address below; Ctrl-C stops it)", flush=True)
    run_server(app, args.host, args.port)
    return 0


# ------------------------------------------------------------------------------------------------------------- bench


def benchmark_names() -> list[str]:
    """Benchmarks by their command-line names: module `decode_context` is `bench decode-context`."""
    import a4.bench

    modules = pkgutil.iter_modules(a4.bench.__path__)
    return sorted(module.name.replace("_", "-") for module in modules if not module.name.startswith("_"))


def run_bench(args: argparse.Namespace) -> int:
    available = benchmark_names()
    if args.name is not None and args.name not in available:
        raise UsageError(f"unknown benchmark {args.name!r} (available: {', '.join(available) or 'none yet'})")
    options = {option: getattr(args, option) for option in BENCH_OPTIONS if getattr(args, option) is not None}
    for option in options:
        if args.name != BENCH_OPTIONS[option]:
            raise UsageError(f"--{option.replace('_', '-')} is an option of bench {BENCH_OPTIONS[option]} only")
    names = [args.name] if args.name else available
    if not names:
        print("no benchmarks in a4/bench yet")
    from a4.bench import Unavailable

    failed = []
    for name in names:
        print(f"== bench {name}", flush=True)
        module = importlib.import_module(f"a4.bench.{name.replace('-', '_')}")
        out_dir = args.out or getattr(module, "DEFAULT_OUT_DIR", DEFAULT_BENCH_OUT)
        try:
            module.main(quick=args.quick, out_dir=out_dir, **options)
        except NotImplementedError as e:
            # The benchmarks measure the student's Qwen3.5 code: until it is written, say which exercise is missing.
            if (missing := unwritten_exercise(e)) is None:
                raise
            print(f"bench {name} cannot run yet: {not_written_yet(missing)}")
            failed.append(name)
        except Unavailable as e:
            print(f"bench {name} cannot run on this machine: {e}", file=sys.stderr if args.name else sys.stdout)
            if args.name:  # asked for by name: a failure; among all of them: skipped
                failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
