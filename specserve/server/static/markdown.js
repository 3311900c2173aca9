// A safe markdown subset for model output: paragraphs, fenced code blocks, inline code, lists
// and **bold**. Everything else is shown literally.
//
// `parse` turns text into a tree of plain objects; `render` builds DOM nodes from it with
// createElement and text nodes only. Model text never goes through innerHTML, so "<script>" or
// "<img onerror=...>" in a reply is displayed as the characters it is.
//
// Every text leaf remembers where it came from in the source (`start`), so `render` can wrap
// chosen source ranges (the characters that arrived through accepted draft tokens) in
// <span class="tok-draft"> without the parser knowing anything about speculation.

const FENCE_OPEN = /^ {0,3}(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])([ \t]+|$)/;

/** Split `src` into lines, each with the offset of its first character. */
function splitLines(src) {
  const lines = [];
  let start = 0;
  for (;;) {
    const nl = src.indexOf("\n", start);
    const end = nl === -1 ? src.length : nl;
    lines.push({ text: src.slice(start, end), start });
    if (nl === -1) return lines;
    start = nl + 1;
  }
}

const isBlank = (line) => line.text.trim() === "";

function itemMarker(line) {
  const m = ITEM.exec(line.text);
  if (!m) return null;
  const ordered = /\d/.test(m[2][0]);
  return {
    ordered,
    number: ordered ? parseInt(m[2], 10) : null,
    contentOffset: m[0].length,
  };
}

function fenceOpen(line) {
  const m = FENCE_OPEN.exec(line.text);
  // A backtick fence's info string may not contain backticks ("```a```" is inline code).
  return m ? { char: m[1][0], length: m[1].length, lang: m[2] } : null;
}

function isFenceClose(line, fence) {
  const m = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(line.text);
  return m !== null && m[1][0] === fence.char && m[1].length >= fence.length;
}

/** Parse `src` into blocks: {type: "para" | "code" | "list", ...}. */
export function parse(src) {
  const lines = splitLines(src);
  const blocks = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = fenceOpen(line);
    if (fence) {
      i += 1;
      const body = [];
      let closed = false;
      while (i < lines.length) {
        if (isFenceClose(lines[i], fence)) {
          closed = true;
          i += 1;
          break;
        }
        body.push(lines[i]);
        i += 1;
      }
      // While a reply streams the closing fence may not have arrived yet: show an open block.
      const start = body.length ? body[0].start : line.start + line.text.length;
      blocks.push({
        type: "code",
        lang: fence.lang,
        text: body.map((l) => l.text).join("\n"),
        start,
        closed,
      });
    } else if (isBlank(line)) {
      i += 1;
    } else if (itemMarker(line)) {
      i = parseList(lines, i, blocks);
    } else {
      const para = [];
      while (i < lines.length && !isBlank(lines[i]) && !fenceOpen(lines[i]) &&
             !itemMarker(lines[i])) {
        para.push(lines[i]);
        i += 1;
      }
      blocks.push({ type: "para", lines: para.map((l) => parseInline(l.text, l.start)) });
    }
  }
  return blocks;
}

function parseList(lines, i, blocks) {
  const first = itemMarker(lines[i]);
  const list = { type: "list", ordered: first.ordered, first: first.number, items: [] };
  while (i < lines.length) {
    const marker = itemMarker(lines[i]);
    if (!marker || marker.ordered !== list.ordered) break;
    const head = lines[i];
    const item = [parseInline(head.text.slice(marker.contentOffset),
                              head.start + marker.contentOffset)];
    i += 1;
    // Continuation: following non-blank lines that start no new block belong to the item.
    while (i < lines.length && !isBlank(lines[i]) && !itemMarker(lines[i]) &&
           !fenceOpen(lines[i])) {
      const text = lines[i].text;
      const indent = text.length - text.trimStart().length;
      item.push(parseInline(text.slice(indent), lines[i].start + indent));
      i += 1;
    }
    list.items.push(item);
    // One blank line between items keeps the list going; anything else after it ends the list.
    if (i + 1 < lines.length && isBlank(lines[i]) && itemMarker(lines[i + 1])?.ordered ===
        list.ordered) {
      i += 1;
    }
  }
  blocks.push(list);
  return i;
}

/**
 * Inline spans of one line: text, `code` and **strong** (which may contain code).
 * `base` is the offset of text[0] in the whole source.
 */
export function parseInline(text, base = 0) {
  const out = [];
  let plainStart = 0;
  const flush = (end) => {
    if (end > plainStart) {
      out.push({ type: "text", text: text.slice(plainStart, end), start: base + plainStart });
    }
  };
  let i = 0;
  while (i < text.length) {
    if (text[i] === "`") {
      let n = 1;
      while (text[i + n] === "`") n += 1;
      const close = findBacktickRun(text, i + n, n);
      if (close !== -1) {
        flush(i);
        out.push({ type: "code", text: text.slice(i + n, close), start: base + i + n });
        i = close + n;
        plainStart = i;
        continue;
      }
      i += n; // an unmatched run is literal text
      continue;
    }
    if (text.startsWith("**", i) && i + 2 < text.length && !/\s/.test(text[i + 2])) {
      const close = findStrongClose(text, i + 2);
      if (close !== -1) {
        flush(i);
        out.push({ type: "strong",
                   children: parseInline(text.slice(i + 2, close), base + i + 2) });
        i = close + 2;
        plainStart = i;
        continue;
      }
    }
    i += 1;
  }
  flush(text.length);
  return out;
}

function findBacktickRun(text, from, n) {
  let j = text.indexOf("`", from);
  while (j !== -1) {
    let m = 1;
    while (text[j + m] === "`") m += 1;
    if (m === n) return j;
    j = text.indexOf("`", j + m);
  }
  return -1;
}

function findStrongClose(text, from) {
  let j = text.indexOf("**", from);
  while (j !== -1) {
    // A closer needs non-space before it; skip "**" inside an inline code span.
    if (!/\s/.test(text[j - 1]) && !insideCode(text, from, j)) return j;
    j = text.indexOf("**", j + 1);
  }
  return -1;
}

function insideCode(text, from, j) {
  let open = false;
  for (let k = from; k < j; k += 1) if (text[k] === "`") open = !open;
  return open;
}

// ---- DOM ------------------------------------------------------------------------------------

/**
 * Build DOM nodes for `src` into `container` (its old children are replaced).
 * `marks` is a sorted list of non-overlapping [start, end) source ranges to wrap in
 * <span class="tok-draft">; pass [] for none.
 */
export function render(src, container, marks = []) {
  const doc = container.ownerDocument;
  const frag = doc.createDocumentFragment();
  for (const block of parse(src)) frag.appendChild(renderBlock(doc, block, marks));
  container.replaceChildren(frag);
}

function renderBlock(doc, block, marks) {
  if (block.type === "code") {
    const pre = doc.createElement("pre");
    const code = doc.createElement("code");
    if (block.lang) code.dataset.lang = block.lang; // a data attribute, never a class name
    if (!block.closed) pre.classList.add("open");
    appendText(doc, code, block.text, block.start, marks);
    pre.appendChild(code);
    return pre;
  }
  if (block.type === "list") {
    const list = doc.createElement(block.ordered ? "ol" : "ul");
    if (block.ordered && block.first !== 1) list.start = block.first;
    for (const item of block.items) {
      const li = doc.createElement("li");
      appendLines(doc, li, item, marks);
      list.appendChild(li);
    }
    return list;
  }
  const p = doc.createElement("p");
  appendLines(doc, p, block.lines, marks);
  return p;
}

function appendLines(doc, parent, lines, marks) {
  lines.forEach((inlines, k) => {
    if (k > 0) parent.appendChild(doc.createTextNode("\n")); // shown by white-space: pre-wrap
    for (const node of inlines) appendInline(doc, parent, node, marks);
  });
}

function appendInline(doc, parent, node, marks) {
  if (node.type === "text") {
    appendText(doc, parent, node.text, node.start, marks);
  } else if (node.type === "code") {
    const code = doc.createElement("code");
    appendText(doc, code, node.text, node.start, marks);
    parent.appendChild(code);
  } else {
    const strong = doc.createElement("strong");
    for (const child of node.children) appendInline(doc, strong, child, marks);
    parent.appendChild(strong);
  }
}

/** Append `text` (source offset `start`), wrapping the parts inside `marks` in spans. */
function appendText(doc, parent, text, start, marks) {
  const end = start + text.length;
  let pos = start;
  for (let k = firstMarkEndingAfter(marks, start); k < marks.length; k += 1) {
    const [a, b] = marks[k];
    if (a >= end) break;
    const from = Math.max(a, start);
    const to = Math.min(b, end);
    if (from > pos) parent.appendChild(doc.createTextNode(text.slice(pos - start, from - start)));
    const span = doc.createElement("span");
    span.className = "tok-draft";
    span.textContent = text.slice(from - start, to - start);
    parent.appendChild(span);
    pos = to;
  }
  if (pos < end) parent.appendChild(doc.createTextNode(text.slice(pos - start)));
}

function firstMarkEndingAfter(marks, offset) {
  let lo = 0;
  let hi = marks.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (marks[mid][1] <= offset) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}
