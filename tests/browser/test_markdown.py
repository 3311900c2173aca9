"""The markdown renderer (static/markdown.js), run in chromium on hand-picked cases.

Each case renders into a detached <div> and is read back as a small tree: a string is a text
node, a list is [tag(.class), child, ...]. Any element outside the subset, from any input,
fails the last test.
"""

from __future__ import annotations

import pytest

from specserve.engine.async_engine import AsyncEngine
from specserve.llm import build_engine_config
from tests.browser.conftest import serve
from tests.browser.servers import ScriptedCore, ScriptedDelta

pytestmark = pytest.mark.browser

RENDER = """async ([src, marks]) => {
  const md = await import("/static/markdown.js");
  const div = document.createElement("div");
  md.render(src, div, marks);
  const tree = (node) => node.nodeType === Node.TEXT_NODE ? node.data
    : [node.tagName.toLowerCase() + (node.className ? "." + node.className : ""),
       ...[...node.childNodes].map(tree)];
  return [...div.childNodes].map(tree);
}"""

CASES = [
    ("plain", "hello", [["p", "hello"]]),
    ("lines and paragraphs", "a\nb\n\nc", [["p", "a", "\n", "b"], ["p", "c"]]),
    ("bold and inline code", "**bold** and `x`",
     [["p", ["strong", "bold"], " and ", ["code", "x"]]]),
    ("code inside bold", "**a `b` c**", [["p", ["strong", "a ", ["code", "b"], " c"]]]),
    ("unclosed bold stays literal", "**not closed", [["p", "**not closed"]]),
    ("bold needs non-space inside", "** spaced **", [["p", "** spaced **"]]),
    ("unmatched backtick stays literal", "a ` b", [["p", "a ` b"]]),
    ("double backticks hold one", "``a`b``", [["p", ["code", "a`b"]]]),
    ("unordered list", "- a\n* b\n+ c", [["ul", ["li", "a"], ["li", "b"], ["li", "c"]]]),
    ("ordered list", "1. a\n2) b", [["ol", ["li", "a"], ["li", "b"]]]),
    ("list item continues", "- a\n  more\n- b", [["ul", ["li", "a", "\n", "more"], ["li", "b"]]]),
    ("list then paragraph", "- a\n\ntext", [["ul", ["li", "a"]], ["p", "text"]]),
    ("fenced code", "```py\nx = 1\n\ny < 2\n```", [["pre", ["code", "x = 1\n\ny < 2"]]]),
    ("unclosed fence while streaming", "```\nopen", [["pre.open", ["code", "open"]]]),
    ("markdown is literal in code", "```\n**no** `x`\n```", [["pre", ["code", "**no** `x`"]]]),
    ("tilde fence", "~~~\nz\n~~~", [["pre", ["code", "z"]]]),
    ("html is text", "<b>x</b> <script>alert(1)</script>",
     [["p", "<b>x</b> <script>alert(1)</script>"]]),
    ("entities are text", "&lt;b&gt; &amp;", [["p", "&lt;b&gt; &amp;"]]),
    ("headings and links are not in the subset", "# t\n[a](javascript:x)",
     [["p", "# t", "\n", "[a](javascript:x)"]]),
]


@pytest.fixture(scope="module")
def page(tiny_target, chromium):
    """One page for every case: the module is imported from the server like the app does."""
    core = ScriptedCore(build_engine_config(tiny_target, tiny_target, "chain:3",
                                            num_blocks=64), [ScriptedDelta("ok", 1)])
    srv = serve(AsyncEngine(core))
    context = chromium.new_context()
    page = context.new_page()
    page.goto(srv.url)
    yield page
    context.close()
    srv.stop()


@pytest.mark.parametrize("src, want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_render(page, src, want):
    assert page.evaluate(RENDER, [src, []]) == want


def test_draft_marks_follow_source_offsets(page):
    # "abcdef" with [1, 3) marked: the span covers "bc".
    assert page.evaluate(RENDER, ["abcdef", [[1, 3]]]) == [
        ["p", "a", ["span.tok-draft", "bc"], "def"]]
    # Offsets count the source, markers included: "**ab**c" marks [2, 7) = "ab**c".
    assert page.evaluate(RENDER, ["**ab**c", [[2, 7]]]) == [
        ["p", ["strong", ["span.tok-draft", "ab"]], ["span.tok-draft", "c"]]]
    # A mark across a paragraph break splits into one span per block.
    assert page.evaluate(RENDER, ["ab\n\ncd", [[1, 5]]]) == [
        ["p", "a", ["span.tok-draft", "b"]], ["p", ["span.tok-draft", "c"], "d"]]
    # Inside code.
    assert page.evaluate(RENDER, ["```\nxyz\n```", [[5, 6]]]) == [
        ["pre", ["code", "x", ["span.tok-draft", "y"], "z"]]]


HOSTILE = [
    "<img src=x onerror=alert(1)>", "<svg onload=alert(1)>", "**<script>x</script>**",
    "`<iframe src=javascript:alert(1)>`", "- <a href=javascript:alert(1)>x</a>",
    "```\n</code></pre><script>alert(1)</script>\n```", "<!-- c --><style>*{}</style>",
    "\u0000\u001f\ufffd \u202e rtl", "```<script>\nx\n```",
]


def test_no_element_outside_the_subset(page):
    allowed = {"p", "strong", "code", "pre", "pre.open", "ul", "ol", "li", "span.tok-draft"}

    def tags(tree):
        for node in tree:
            if isinstance(node, list):
                yield node[0]
                yield from tags(node[1:])

    for src in HOSTILE:
        tree = page.evaluate(RENDER, [src, [[0, 3]]])
        assert set(tags(tree)) <= allowed, (src, tree)
        assert page.evaluate("window.__pwned") is None
