// A small Markdown renderer with code highlighting for the chat UI: fenced code, inline code, headings,
// lists, quotes, bold, italics, links (http/https only). Everything is HTML-escaped first, so model output
// cannot inject markup.
(function () {
  "use strict";
  const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");

  const KEYWORDS = new Set(("abstract and as async await break case catch class const continue def default del do elif else enum " +
    "except export extends false final finally fn for from func function go if impl import in interface is lambda let " +
    "match mod mut new nil none not null or package pass pub raise return self static struct super switch this throw " +
    "trait true try type typeof use var void while with yield True False None").split(" "));

  // One pass over the code: strings, comments, numbers and keywords become spans, the rest stays text.
  function highlight(code) {
    const re = /("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|\b(\d+(?:\.\d+)?)\b|\b([A-Za-z_]\w*)\b/g;
    let out = "", last = 0, m;
    while ((m = re.exec(code)) !== null) {
      out += esc(code.slice(last, m.index));
      const [text, str, com, num, word] = m;
      if (str) out += `<span class="tok-str">${esc(str)}</span>`;
      else if (com) out += `<span class="tok-com">${esc(com)}</span>`;
      else if (num) out += `<span class="tok-num">${num}</span>`;
      else if (KEYWORDS.has(word)) out += `<span class="tok-kw">${word}</span>`;
      else out += esc(text);
      last = m.index + text.length;
    }
    return out + esc(code.slice(last));
  }

  function inline(text) {
    const codes = [];
    let s = text.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return `\u0000${codes.length - 1}\u0000`; });
    s = esc(s)
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${esc(codes[+i])}</code>`);
  }

  function render(markdown) {
    const lines = markdown.replace(/\r\n/g, "\n").split("\n");
    const out = [];
    let para = [], list = null;
    const flushPara = () => { if (para.length) { out.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`); para = []; } };
    const flushList = () => { if (list) { out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`); list = null; } };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara(); flushList();
        const body = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
        const lang = fence[1] ? ` class="language-${esc(fence[1])}"` : "";
        out.push(`<pre><code${lang}>${highlight(body.join("\n"))}</code></pre>`);  // unclosed: still streaming
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const item = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
      if (heading) { flushPara(); flushList(); out.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`); }
      else if (item) {
        flushPara();
        const tag = item[1] ? "ul" : "ol";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(item[3]);
      } else if (/^>\s?/.test(line)) { flushPara(); flushList(); out.push(`<blockquote>${inline(line.replace(/^>\s?/, ""))}</blockquote>`); }
      else if (!line.trim()) { flushPara(); flushList(); }
      else { flushList(); para.push(line); }
    }
    flushPara(); flushList();
    return out.join("\n");
  }

  window.Markdown = { render, highlight, escape: esc };
})();
