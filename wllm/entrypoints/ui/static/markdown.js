// A small Markdown renderer for model replies: fenced code blocks, headings, lists, block quotes, rules,
// paragraphs; inline code, bold, italic and http(s) links. It builds DOM nodes and sets only
// textContent, never innerHTML, so nothing a model writes can become markup or script.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const INLINE = /(\*\*|__)(.+?)\1|\*([^*\s](?:[^*]*[^*\s])?)\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function safeLink(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

// Emphasis and links inside a run of text without code spans.
function emphasis(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1]) {
      const strong = el("strong");
      emphasis(m[2], strong);
      parent.append(strong);
    } else if (m[3]) {
      const em = el("em");
      emphasis(m[3], em);
      parent.append(em);
    } else {
      const href = safeLink(m[5]);
      if (href) {
        const a = el("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = m[4];
        parent.append(a);
      } else {
        parent.append(m[0]);
      }
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

export function inline(text, parent) {
  const parts = text.split(/(`[^`\n]+`)/);
  for (const part of parts) {
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      const code = el("code");
      code.textContent = part.slice(1, -1);
      parent.append(code);
    } else if (part) {
      emphasis(part, parent);
    }
  }
}

// Render `source` into a DocumentFragment. An unclosed code fence (a reply still streaming) is a code
// block up to the end.
export function render(source) {
  const out = document.createDocumentFragment();
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  let paragraph = null;
  let list = null;
  const close = () => {
    paragraph = null;
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      close();
      const fence = m[1];
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
      const pre = el("pre", "code-block");
      if (m[2]) {
        pre.dataset.lang = m[2];
        const label = el("span", "code-lang");
        label.textContent = m[2];
        pre.append(label);
      }
      const code = el("code");
      code.textContent = body.join("\n");
      pre.append(code);
      out.append(pre);
    } else if (!line.trim()) {
      close();
    } else if ((m = HEADING.exec(line))) {
      close();
      const h = el(`h${Math.min(6, m[1].length + 2)}`);
      inline(m[2], h);
      out.append(h);
    } else if (RULE.test(line)) {
      close();
      out.append(el("hr"));
    } else if ((m = BULLET.exec(line)) || (m = NUMBERED.exec(line))) {
      const ordered = m.length === 3;
      const tag = ordered ? "OL" : "UL";
      if (!list || list.tagName !== tag) {
        paragraph = null;
        list = el(tag.toLowerCase());
        if (ordered && m[1] !== "1") list.start = Number(m[1]);
        out.append(list);
      }
      const li = el("li");
      inline(ordered ? m[2] : m[1], li);
      list.append(li);
    } else if ((m = QUOTE.exec(line))) {
      close();
      const quote = el("blockquote");
      inline(m[1], quote);
      out.append(quote);
    } else if (list && /^\s{2,}\S/.test(line)) {
      // a continuation line of the last list item
      list.lastChild.append(" ");
      inline(line.trim(), list.lastChild);
    } else {
      list = null;
      if (!paragraph) {
        paragraph = el("p");
        out.append(paragraph);
      } else {
        paragraph.append(el("br"));
      }
      inline(line, paragraph);
    }
  }
  return out;
}
