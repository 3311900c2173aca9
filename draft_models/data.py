"""Training text for the demo pair, built offline from Python's own standard library.

The corpus mixes two kinds of documents, both derived from the stdlib sources of the running
interpreter (PSF license, redistributable):

* **code**: each module's source file, prefixed with a ``# file: <path>`` line;
* **chat**: ChatML conversations whose questions ask about a module, function, class or method
  and whose answers come from that object's docstring, signature or source.

Everything is deterministic: files are sorted, every random choice uses a seeded ``random.Random``,
and the validation split is chosen by module (every ``val_every``-th module in sorted order), so
no validation object leaks into training through another document.

This module also turns token streams into training windows (``WindowSampler``) and fixed
validation windows; those helpers know nothing about the stdlib and are reused by ``distill.py``
for a user's own text files.
"""

from __future__ import annotations

import ast
import inspect
import random
import sysconfig
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .tokenizer import ENDOFTEXT, render_chat

# Directories that are test suites, generated tables or vendored data rather than library code.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__",
                        "pydoc_data", "encodings", "lib2to3", "turtledemo", "ensurepip"})
# Larger files are generated tables or giant modules that would dominate the code stream.
_MAX_FILE_BYTES = 250_000
# "Show me the source" answers longer than this are skipped: they would be mostly truncated.
_MAX_SOURCE_LINES = 40
_MAX_ANSWER_CHARS = 700

_FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)

SYSTEM_PROMPT = "You are a helpful assistant that knows the Python standard library."


@dataclass(frozen=True)
class Module:
    """One stdlib source file: its dotted name, path relative to the stdlib root, and text."""

    name: str
    relpath: str
    source: str


@dataclass
class Corpus:
    """Train/validation documents; ``val_questions`` are held-out first user turns."""

    train_code: list[str] = field(default_factory=list)
    train_chat: list[str] = field(default_factory=list)
    val_code: list[str] = field(default_factory=list)
    val_chat: list[str] = field(default_factory=list)
    val_questions: list[str] = field(default_factory=list)
    train_modules: list[str] = field(default_factory=list)
    val_modules: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        """Document and character counts, for logs and the model card."""
        return {
            "train_modules": len(self.train_modules),
            "val_modules": len(self.val_modules),
            "train_code_docs": len(self.train_code),
            "train_chat_docs": len(self.train_chat),
            "val_code_docs": len(self.val_code),
            "val_chat_docs": len(self.val_chat),
            "train_chars": sum(map(len, self.train_code)) + sum(map(len, self.train_chat)),
            "val_chars": sum(map(len, self.val_code)) + sum(map(len, self.val_chat)),
        }


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_modules(root: Path | None = None) -> list[Module]:
    """All library ``.py`` files under ``root``, sorted by dotted module name."""
    root = root or stdlib_root()
    modules = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(Module(".".join(parts), rel.as_posix(), source))
    modules.sort(key=lambda m: m.name)
    return modules


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line (docstrings wrap at ~72 columns)."""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    text = " ".join(para.split())
    if len(text) > _MAX_ANSWER_CHARS:
        text = text[:_MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return text


def _first_sentence(text: str) -> str:
    head, dot, _ = text.partition(". ")
    return head + "." if dot else text


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return ast.unparse(node.args)


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names as written in a call (``*args``, ``**kwargs``), minus self/cls."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _qa_for_function(qual: str, node: ast.FunctionDef | ast.AsyncFunctionDef,
                     lines: Sequence[str], rng: random.Random) -> list[tuple[str, str]]:
    """Question/answer pairs about one documented function or method."""
    doc = ast.get_docstring(node)
    pairs: list[tuple[str, str]] = []
    if doc:
        para = _first_paragraph(doc)
        if para:
            q = rng.choice([
                f"What does `{qual}` do?",
                f"Explain `{qual}`.",
                f"What is `{qual}` for?",
                f"Can you tell me what `{qual}` does?",
            ])
            pairs.append((q, para))
            pairs.append((f"Summarize `{qual}` in one sentence.", _first_sentence(para)))
    sig = f"{qual}({_signature(node)})"
    params = _parameters(node)
    listed = ", ".join(f"`{p}`" for p in params) if params else "no arguments"
    pairs.append((
        rng.choice([f"What are the parameters of `{qual}`?", f"What is the signature of `{qual}`?",
                    f"How do I call `{qual}`?"]),
        f"The signature is `{sig}`. It takes {listed}.",
    ))
    # Slicing lines directly: ast.get_source_segment re-splits the whole file on every call.
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    last = node.end_lineno or node.lineno
    if last - first < _MAX_SOURCE_LINES:
        code = textwrap.dedent("\n".join(lines[first - 1:last]))  # methods start indented
        pairs.append((rng.choice([f"Show me the source of `{qual}`.",
                                  f"How is `{qual}` implemented?"]),
                      f"Here is the source of `{qual}`:\n```python\n{code}\n```"))
    return pairs


def _qa_for_class(qual: str, node: ast.ClassDef) -> list[tuple[str, str]]:
    doc = ast.get_docstring(node)
    pairs: list[tuple[str, str]] = []
    if doc and _first_paragraph(doc):
        pairs.append((f"What is the `{qual}` class?", _first_paragraph(doc)))
    methods = [n.name for n in node.body
               if isinstance(n, _FUNCTION_NODES) and not n.name.startswith("_")]
    if methods:
        listed = ", ".join(f"`{m}`" for m in methods[:12])
        pairs.append((f"Which public methods does `{qual}` have?",
                      f"`{qual}` defines {listed}."))
    return pairs


def module_qa(module: Module, rng: random.Random) -> list[tuple[str, str]]:
    """All question/answer pairs about one module, in source order."""
    try:
        tree = ast.parse(module.source)
    except SyntaxError:
        return []
    lines = module.source.splitlines()
    pairs: list[tuple[str, str]] = []
    doc = ast.get_docstring(tree)
    if doc and _first_paragraph(doc):
        pairs.append((rng.choice([f"What is the `{module.name}` module for?",
                                  f"What does the `{module.name}` module do?"]),
                      _first_paragraph(doc)))
    for node in tree.body:
        if isinstance(node, _FUNCTION_NODES) and not node.name.startswith("_"):
            qual = f"{module.name}.{node.name}"
            pairs += _qa_for_function(qual, node, lines, rng)
            pairs.append((f"Where is `{node.name}` defined?",
                          f"`{node.name}` is a function in the `{module.name}` module"
                          + f" (`Lib/{module.relpath}`)."))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            qual = f"{module.name}.{node.name}"
            pairs += _qa_for_class(qual, node)
            for sub in node.body:
                if (isinstance(sub, _FUNCTION_NODES)
                        and not sub.name.startswith("_") and ast.get_docstring(sub)):
                    pairs += _qa_for_function(f"{qual}.{sub.name}", sub, lines, rng)
    return pairs


def chat_documents(pairs: Sequence[tuple[str, str]], rng: random.Random) -> list[str]:
    """Group shuffled pairs into 1-3 turn ChatML conversations, some with a system prompt."""
    pairs = list(pairs)
    rng.shuffle(pairs)
    docs = []
    i = 0
    while i < len(pairs):
        n = rng.choice((1, 1, 2, 3))
        messages = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": SYSTEM_PROMPT})
        for q, a in pairs[i:i + n]:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        docs.append(render_chat(messages) + ENDOFTEXT)
        i += n
    return docs


def build_corpus(val_every: int = 20, seed: int = 0, root: Path | None = None) -> Corpus:
    """The stdlib corpus; every ``val_every``-th module (sorted by name) is held out."""
    corpus = Corpus()
    for index, module in enumerate(list_modules(root)):
        # One generator per module so a module's documents do not depend on the others.
        rng = random.Random(f"{seed}:{module.name}")
        held_out = index % val_every == val_every // 2
        code = f"# file: Lib/{module.relpath}\n{module.source}{ENDOFTEXT}"
        pairs = module_qa(module, rng)
        chats = chat_documents(pairs, rng)
        if held_out:
            corpus.val_modules.append(module.name)
            corpus.val_code.append(code)
            corpus.val_chat += chats
            # Documentation questions only: "show me the source" replies are mostly copying.
            corpus.val_questions += [q for q, _ in pairs if not q.startswith(("Show", "How is"))]
        else:
            corpus.train_modules.append(module.name)
            corpus.train_code.append(code)
            corpus.train_chat += chats
    return corpus


def pick_questions(questions: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """A deterministic, evenly spread sample of ``n`` held-out questions."""
    if len(questions) <= n:
        return list(questions)
    stride = len(questions) / n
    picked = [questions[int(i * stride)] for i in range(n)]
    random.Random(seed).shuffle(picked)
    return picked


def concat_stream(token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate tokenized documents (each already ends with its separator) into one stream."""
    total = sum(len(t) for t in token_lists)
    out = torch.empty(total, dtype=torch.long)
    pos = 0
    for toks in token_lists:
        out[pos:pos + len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        pos += len(toks)
    return out


class WindowSampler:
    """Endless batches of random ``seq_len + 1`` windows drawn from weighted token streams.

    Each batch row picks its stream with the given weights (rows are split deterministically,
    not sampled, so every batch has the same mix) and a uniformly random start inside it.
    """

    def __init__(self, streams: Sequence[torch.Tensor], weights: Sequence[float], seq_len: int,
                 batch_size: int, seed: int = 0) -> None:
        if len(streams) != len(weights):
            raise ValueError("one weight per stream")
        for s in streams:
            if s.numel() <= seq_len + 1:
                raise ValueError(f"stream of {s.numel()} tokens is shorter than a window")
        self.streams = list(streams)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        total = sum(weights)
        counts = [round(batch_size * w / total) for w in weights]
        counts[-1] = batch_size - sum(counts[:-1])
        self.rows_per_stream = counts

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        rows = []
        for stream, count in zip(self.streams, self.rows_per_stream):
            if count <= 0:
                continue
            starts = torch.randint(0, stream.numel() - self.seq_len - 1, (count,),
                                   generator=self.generator)
            rows += [stream[s:s + self.seq_len + 1] for s in starts.tolist()]
        return torch.stack(rows)  # [batch_size, seq_len + 1]


def fixed_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping ``seq_len + 1`` windows spread evenly over ``stream``, for validation."""
    n_avail = (stream.numel() - 1) // seq_len
    n = min(n_avail, max_windows)
    if n == 0:
        raise ValueError("validation stream is shorter than one window")
    starts = [int(i * n_avail / n) * seq_len for i in range(n)]
    return torch.stack([stream[s:s + seq_len + 1] for s in starts])  # [n, seq_len + 1]


def read_text_files(paths: Sequence[str | Path],
                    suffixes: Sequence[str] = (".txt", ".md", ".py", ".rst", ".json", ".jsonl")
                    ) -> list[str]:
    """Text of the given files, and of files with a known suffix under given directories, sorted."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(p)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue  # binary or non-UTF-8 files are not training text
    return texts
