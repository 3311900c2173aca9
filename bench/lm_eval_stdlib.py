"""lm-evaluation-harness (`local-completions`) against a running specserve, on a local task.

    specserve serve &                                  # the demo pair on :8000
    pip install "lm-eval[api]"                         # not a specserve dependency
    python -m bench lm-eval --base-url http://127.0.0.1:8000 [--batch-size 8] [--limit 40]

The harness's own tasks download their datasets from the Hugging Face hub; this one is built
here, offline, from the running interpreter's standard library (the demo pair's domain): for each
of a fixed list of functions, the ChatML question "What does `mod.func` do?" and four candidate
answers, the first paragraph of that function's docstring and of three others. lm-eval scores each
choice with a log-likelihood request (token-id prompts in one list, `echo`, `max_tokens: 1`,
`logprobs: 1`, the server's `/tokenize` and `/tokenizer_info` as its tokenizer) and reports
accuracy (chance 0.25), also length-normalised. Printed: accuracies, requests, wall time.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import tempfile
import time
from pathlib import Path

FUNCTIONS = (
    "json.dumps", "json.loads", "textwrap.wrap", "textwrap.dedent", "os.path.join",
    "os.path.splitext", "heapq.heappush", "heapq.nlargest", "bisect.insort", "shlex.split",
    "shlex.quote", "fnmatch.fnmatch", "glob.glob", "colorsys.rgb_to_hsv", "random.shuffle",
    "random.choice", "re.sub", "re.split", "shutil.copyfile", "shutil.rmtree",
    "functools.reduce", "itertools.groupby", "base64.b64encode", "html.escape",
    "urllib.parse.urlsplit", "urllib.parse.quote", "string.capwords", "copy.deepcopy",
    "tempfile.mkdtemp", "zlib.compress", "statistics.median", "statistics.mean",
    "difflib.get_close_matches", "calendar.isleap", "operator.itemgetter", "math.gcd",
    "keyword.iskeyword", "ntpath.basename", "posixpath.normpath", "csv.reader",
)
TASK = "specserve_stdlib_mc"


def _summary(name: str) -> str | None:
    module, _, attr = name.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    doc = inspect.getdoc(obj)
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else None


def build_docs(seed: int = 0) -> list[dict]:
    """One multiple-choice document per function with a docstring; deterministic."""
    from specserve.draft_models.tokenizer import render_chat

    summaries = {n: s for n in FUNCTIONS if (s := _summary(n))}
    names = sorted(summaries)
    rng = random.Random(seed)
    docs = []
    for name in names:
        others = rng.sample([n for n in names if summaries[n] != summaries[name]], 3)
        choices = [summaries[n] for n in others]
        label = rng.randrange(4)
        choices.insert(label, summaries[name])
        question = render_chat([{"role": "user", "content": f"What does `{name}` do?"}],
                               add_generation_prompt=True)
        docs.append({"question": question, "choices": choices, "label": label})
    return docs


def write_task(folder: Path, docs: list[dict]) -> None:
    data = folder / "stdlib_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def main(argv: list[str] | None = None, prog: str = "python -m bench lm-eval") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the server's only one)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise SystemExit('lm-evaluation-harness is not installed: pip install "lm-eval[api]"'
                         ) from None
    import httpx

    model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    docs = build_docs()
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), docs)
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": model, "base_url": f"{args.base_url}/v1/completions",
                        "tokenizer_backend": "remote", "tokenized_requests": True,
                        "max_retries": 1},
            tasks=[TASK], task_manager=TaskManager(include_path=tmp),
            batch_size=args.batch_size, limit=args.limit)
        wall = time.perf_counter() - start
    metrics = results["results"][TASK]
    n_docs = min(len(docs), args.limit or len(docs))
    print(f"{TASK}: {n_docs} questions x 4 choices = {4 * n_docs} loglikelihood requests, "
          f"batch size {args.batch_size}")
    print(f"acc {metrics['acc,none']:.3f} +- {metrics['acc_stderr,none']:.3f}, acc_norm "
          f"(per byte) {metrics['acc_norm,none']:.3f} (chance 0.25), wall {wall:.1f} s")
