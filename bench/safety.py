"""What the safety filters cost a clean request (target: under 5 ms p95 added by the input filter).

    .venv/bin/python bench/safety.py                 # in-process timings, then a running system (~1 min)
    .venv/bin/python bench/safety.py --no-system     # in-process timings only

In process, on clean English prompts of realistic sizes (a chat turn of 200 characters to a 256 kB document):
- the input filter as the gateway runs it (``InputSafety.screen`` on an admission ticket: rules, classifier over
  windows, metrics; on the event loop up to ``inline_max_chars``, on a thread above), and its parts alone: the rule
  set, the classifier; the wheel's own ``predict_prob`` for comparison;
- the same judgement always inline and always on a thread (``asyncio.to_thread``), for the crossover;
- the output filter per generated token (``StreamGuard.feed`` on ~4-character tokens).

On a running system (``LocalSystem``: embedded NATS and Postgres, one gateway, one worker on the tiny random
model, whose steps take about a millisecond, so the filters' share is as visible as it can be): streamed chats
with a 1 kB clean prompt from a tenant on ``block`` and one on ``off``, max_tokens 1 and 16, in a shuffled order,
one at a time; TTFT (send to the first chunk with text) per tenant. Prints ``lscpu`` and appends a section to
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.engine import pct  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

PROSE = [
    "Please summarize the following report for the board in three short paragraphs.",
    "Revenue grew by eight percent in the third quarter, driven by demand for storage products in Europe and Asia.",
    "Operating costs rose more slowly than revenue, so the operating margin improved for the second time this year.",
    "The company hired two hundred engineers, opened an office in Lisbon and moved its support team to one site.",
    "Next year it plans to expand the support team, renew the delivery fleet and invest in energy efficiency.",
    "Customers asked for shorter delivery times, clearer invoices and a mobile application for tracking orders.",
    "The board approved a dividend of forty cents per share and a program to buy back shares over two years.",
    "Write the answer in plain language for readers who are not specialists, and end with three open questions.",
]
SIZES = {"chat turn": 200, "1 kB": 1_000, "4 kB": 4_000, "16 kB": 16_000, "64 kB": 64_000, "256 kB": 256_000}


def prose(num_chars: int, offset: int = 0) -> str:
    out, i = "", offset
    while len(out) < num_chars:
        out += PROSE[i % len(PROSE)] + " "
        i += 1
    return out[:num_chars]


def ms(samples: list[float]) -> tuple[str, str, str]:
    return tuple(f"{pct(samples, q) * 1000:.3f}" for q in (50, 95, 99))


def time_calls(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


async def time_awaits(make, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await make()
        out.append(time.perf_counter() - t)
    return out


def in_process(n: int) -> tuple[str, dict]:
    from switchyard.domain.admission.safety import InputSafety
    from switchyard.domain.admission.ticket import Origin, Ticket
    from switchyard.domain.auth import AuthContext
    from switchyard.shared.config import SafetyConfig
    from switchyard.shared.messages import GenerateRequest, SamplingParams
    from switchyard.shared.profanity import load_classifier
    from switchyard.shared.safety import filter_for
    from switchyard.workers.serving.output_filter import OutputSafety

    t = time.perf_counter()
    safety = InputSafety(SafetyConfig())
    load_s = time.perf_counter() - t
    from profanity_check import predict_prob  # after the timing above: importing it loads the model too
    inline = InputSafety(SafetyConfig(inline_max_chars=1 << 40))
    threaded = InputSafety(SafetyConfig(inline_max_chars=0))
    judge, classifier = safety.filter, load_classifier()
    rows, p95 = [], {}
    for label, size in SIZES.items():
        text = prose(size)
        auth = AuthContext("bench", "bench", "key", "pro", None, None, None, safety_policy="block")
        request = Ticket(Origin.REQUEST, auth, "bench", "m", texts=[text], safety=safety.wire_policy(auth))
        assert judge.check(text).allowed, label  # clean, or the numbers would time a refusal
        reps = max(50, n * 200 // size) if size > 1000 else n
        screen = asyncio.run(time_awaits(lambda: safety.screen(request), reps))
        on_loop = asyncio.run(time_awaits(lambda: inline.screen(request), reps))
        on_thread = asyncio.run(time_awaits(lambda: threaded.screen(request), reps))
        rules = time_calls(lambda: judge.rules.match(text), reps)
        clf = time_calls(lambda: classifier.max_probability(classifier.words(text)), reps)
        wheel = time_calls(lambda: predict_prob([text]), max(20, reps // 10))
        p95[label] = pct(screen, 95) * 1000
        where = "loop" if len(text) <= safety._config.inline_max_chars else "thread"
        rows.append([label, len(text), where, *ms(screen), ms(on_loop)[1], ms(on_thread)[1], ms(rules)[1],
                     ms(clf)[1], ms(wheel)[1]])
    table = markdown_table(["prompt", "chars", "runs on", "input filter p50 ms", "p95", "p99", "always inline p95",
                            "always on a thread p95", "rules alone p95", "classifier alone p95",
                            "wheel's predict_prob p95"], rows)

    # The output filter: a clean reply fed token by token (~4 characters, as BPE tokens of English run).
    reply = prose(4000, offset=3)
    tokens = [reply[i:i + 4] for i in range(0, len(reply), 4)]
    per_token: list[float] = []
    out = OutputSafety()
    policy = safety.wire_policy(tenant_policy="block")
    filter_for(policy)  # compiled once per rule set, as a worker does at the first request
    for _ in range(max(5, n // 100)):
        guard = out.guard(GenerateRequest("bench", "m", "pro", SamplingParams(), 0.0, 0.0, prompt="x",
                                          safety=policy), 0)
        for tok in tokens:
            t = time.perf_counter()
            guard.feed(tok)
            per_token.append(time.perf_counter() - t)
        assert not guard.is_halted
    out_line = (f"Output filter per generated token (a clean 4 kB reply in 4-character tokens, {len(per_token)} "
                f"tokens): p50 {pct(per_token, 50) * 1e6:.1f} us, p95 {pct(per_token, 95) * 1e6:.1f} us, "
                f"p99 {pct(per_token, 99) * 1e6:.1f} us.")
    summary = {"load_s": load_s, "p95": p95, "table": table, "output": out_line}
    return table, summary


def on_a_system(num_requests: int, max_tokens: list[int]) -> dict[tuple[int, str], list[float]]:
    """TTFT samples per (max_tokens, policy)."""
    import httpx

    from switchyard.deploy.system import LocalSystem
    from switchyard.domain.tenancy import update_tenant
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port, make_key
    from tests.support.tiny_model import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="switchyard-safetybench-"))
    os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
    model = save_tiny_model(work / "tiny", max_context=4096)
    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port()),
                              worker=WorkerConfig(model=str(model), served_model_name="tiny", dtype="float32"))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    try:
        system.start_servers()

        async def keys() -> dict[str, str]:
            import asyncpg

            out = {}
            for policy in ("block", "off"):
                out[policy] = await make_key(config.database_url, f"bench-{policy}", "pro", rpm_limit=10**6,
                                             tpm_limit=10**9)
                conn = await asyncpg.connect(config.database_url)
                try:
                    await update_tenant(conn, f"bench-{policy}", safety_policy=policy)
                finally:
                    await conn.close()
            return out

        secrets = asyncio.run(keys())
        system.start_worker()
        system.start_gateway()
        system.wait_until_ready("tiny", timeout_s=300)
        ttft: dict[tuple[int, str], list[float]] = {}
        # Every (length, policy) the same number of times, in a shuffled order: no kind always follows another
        # (what a request leaves behind, its usage record and billing insert, lands on the next one's start).
        warmup = [(t, p) for t in max_tokens for p in ("block", "off")] * 5
        schedule = [(t, p) for t in max_tokens for p in ("block", "off")] * num_requests
        random.Random(0).shuffle(schedule)
        with httpx.Client(base_url=system.url(), timeout=60) as http:
            for i, (tokens, policy) in enumerate(warmup + schedule):
                time.sleep(0.02)  # one at a time, each on a quiet system
                body = {"model": "tiny", "messages": [{"role": "user", "content": prose(1000)}], "stream": True,
                        "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
                t = time.perf_counter()
                first = None
                with http.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {secrets[policy]}"}) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if first is None and '"content":"' in line and '"content":""' not in line:
                            first = time.perf_counter() - t
                if i >= len(warmup):
                    ttft.setdefault((tokens, policy), []).append(first if first is not None else float("nan"))
        return ttft
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2000, help="timed calls per size (fewer for the large ones)")
    p.add_argument("--no-system", dest="system", action="store_false", help="skip the running-system TTFT part")
    p.add_argument("--requests", type=int, default=150, help="streamed requests per tenant on the system")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16],
                   help="1: the first chunk is the reply's end for both policies, so only the input path differs")
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(lscpu)
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    table, summary = in_process(args.n)
    print(table + "\n\n" + summary["output"])
    worst = max(v for label, v in summary["p95"].items() if SIZES[label] <= 64_000)
    text = (f"## Safety filters: latency added to a clean request ({time.strftime('%Y-%m-%d')})\n\n"
            f"`{command_line()}` on {cpu}, {os.cpu_count()} CPUs. Default rule set (built-ins) and classifier "
            f"(alt-profanity-check, threshold 0.9), loaded once in {summary['load_s']:.2f} s. Clean English prose; "
            f"`input filter` is `InputSafety.screen` on an admission ticket, as the gateway runs it before "
            "queueing.\n\n"
            f"{table}\n\n{summary['output']}\n\nWorst input-filter p95 up to 64 kB (16k tokens): {worst:.2f} ms "
            f"(target < 5 ms); 256 kB: {summary['p95']['256 kB']:.2f} ms, on a thread.\n")
    if args.system:
        ttft = on_a_system(args.requests, args.max_tokens)
        rows = []
        for tokens in args.max_tokens:
            on, off = ttft[(tokens, "block")], ttft[(tokens, "off")]
            for policy, xs in (("block", on), ("off", off)):
                rows.append([tokens, policy, len(xs), f"{statistics.fmean(xs) * 1000:.2f}", *ms(xs)])
            rows.append([tokens, "**block - off**", "", f"{(statistics.fmean(on) - statistics.fmean(off)) * 1000:+.2f}",
                         *(f"{(pct(on, q) - pct(off, q)) * 1000:+.2f}" for q in (50, 95, 99))])
        system_table = markdown_table(["max_tokens", "tenant policy", "requests", "TTFT mean ms", "p50", "p95",
                                       "p99"], rows)
        print(system_table)
        text += (f"\nOn a running system (tiny random model, streamed chat, 1 kB clean prompt, one request at a "
                 f"time, 20 ms apart, the two tenants and the two lengths in a shuffled order; all processes on these "
                 f"{os.cpu_count()} CPUs):\n\n{system_table}\n\nWith max_tokens 1 the first chunk is the reply's end "
                 f"under both policies, so the difference is the input path's. With more tokens `block` also "
                 f"holds a reply's first word back until it is complete (the output filter), which can delay the "
                 f"first chunk by a decode step or more (the random model writes long runs of word characters).\n")
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
