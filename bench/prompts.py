"""The built-in prompt set of `bench/serve.py`: chat questions from the demo model's domain.

The demo pair is trained on Python standard library docstrings turned into chat Q/A
(`draft_models/data.py`), so these are the kinds of questions it answers: what a function
does, its signature, a one-sentence summary, what a class or module is for. A few carry the
system prompt the training conversations use, and a few are two-turn chats.
"""

from __future__ import annotations

SYSTEM_PROMPT = "You are a helpful assistant that knows the Python standard library."

QUESTIONS = [
    "What does `json.dumps` do?",
    "Explain `textwrap.wrap`.",
    "What is `os.path.join` for?",
    "Can you tell me what `shutil.copyfile` does?",
    "Summarize `functools.lru_cache` in one sentence.",
    "What are the parameters of `subprocess.run`?",
    "What is the signature of `itertools.groupby`?",
    "How do I call `re.sub`?",
    "What is the `collections.OrderedDict` class?",
    "Which public methods does `pathlib.Path` have?",
    "What is the `heapq` module for?",
    "What does the `bisect` module do?",
    "What does `random.shuffle` do?",
    "Explain `glob.glob`.",
    "What is `tempfile.mkdtemp` for?",
    "Summarize `urllib.parse.urlsplit` in one sentence.",
    "What are the parameters of `logging.basicConfig`?",
    "Where is `fnmatch` defined?",
    "What is the `argparse.ArgumentParser` class?",
    "Can you tell me what `base64.b64encode` does?",
    "How do I call `datetime.datetime.strftime`?",
    "What does `statistics.median` do?",
    "What is the `threading.Lock` class?",
    "Explain `inspect.signature`.",
    "What does the `csv` module do?",
]

# (system prompt or None, [user, assistant, user, ...]) for the chats that are not one question.
CONVERSATIONS = [
    (SYSTEM_PROMPT, ["What does `copy.deepcopy` do?"]),
    (SYSTEM_PROMPT, ["What is the `queue.Queue` class?"]),
    (SYSTEM_PROMPT, ["Summarize `zipfile.ZipFile.extractall` in one sentence."]),
    (None, ["What does `os.makedirs` do?",
            "It creates a leaf directory and all intermediate ones.",
            "What are the parameters of `os.makedirs`?"]),
    (SYSTEM_PROMPT, ["What is the `string` module for?",
                     "It holds common string constants and classes.",
                     "Explain `string.capwords`."]),
]


def _chat(system: str | None, turns: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    messages += [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return messages


def builtin_chats() -> list[list[dict]]:
    """The built-in chats (30): lists of `{role, content}` messages ending with a user turn."""
    return [_chat(None, [q]) for q in QUESTIONS] + [_chat(s, t) for s, t in CONVERSATIONS]
