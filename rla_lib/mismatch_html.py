"""`rla measure --report FILE.html`: one self-contained page per measurement, opened in any browser, nothing fetched.

    html = page(run, df, advice_lines, modes, tokenizer, title="qwen3-tiny on prompts.jsonl")

The page holds the summary table and the advice `rla measure` prints, then every prompt's responses token by token,
each token coloured by its logprob difference d = engine - training side: red where the engine gives the token more
probability, blue where the training side does, white where they are equal bit for bit; the strength is |d| against
the largest |d| of that comparison. A menu picks the comparison (engine mode and training side), a button orders the
prompts worst first (the largest |d| among its responses' tokens) or as given; hovering a token shows both logprobs.
"""

from __future__ import annotations

import html
import json

import numpy as np

from . import sides
from .mismatch_report import HEADER, row_cells, side_labels
from .mismatch_run import MismatchRun

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
.prompt { margin: 1.2em 0; padding: .6em; border: 1px solid #ddd; border-radius: 4px; }
.response { font-family: ui-monospace, monospace; margin: .3em 0; white-space: pre-wrap; }
.tok { border-radius: 2px; padding: 0 1px; }
.controls { position: sticky; top: 0; background: #fff; padding: .5em 0; border-bottom: 1px solid #ddd; }
"""

SCRIPT = """
const data = JSON.parse(document.getElementById("diffs").textContent);
const menu = document.getElementById("comparison"), order = document.getElementById("order");
const prompts = Array.from(document.querySelectorAll(".prompt")), given = prompts.slice();
let worstFirst = false;
function colour(d, scale) {
  if (d === 0) return "rgb(255, 255, 255)";
  const a = Math.min(1, Math.abs(d) / scale), c = Math.round(255 * (1 - 0.75 * a));
  return d > 0 ? `rgb(255, ${c}, ${c})` : `rgb(${c}, ${c}, 255)`;
}
function paint() {
  const cmp = data.comparisons[menu.value];
  document.querySelectorAll(".tok").forEach((el) => {
    const i = +el.dataset.i, d = cmp.diff[i];
    el.style.backgroundColor = colour(d, cmp.scale);
    el.title = `engine ${cmp.engine[i]}, training ${cmp.training[i]}, d = ${d}`;
  });
  prompts.forEach((p) => { p.dataset.worst = cmp.worst[+p.dataset.k]; });
  arrange();
}
function arrange() {
  const list = worstFirst ? given.slice().sort((a, b) => b.dataset.worst - a.dataset.worst) : given;
  const box = document.getElementById("prompts");
  list.forEach((p) => box.appendChild(p));
  order.textContent = worstFirst ? "show prompts in the given order" : "show the worst prompts first";
}
menu.addEventListener("change", paint);
order.addEventListener("click", () => { worstFirst = !worstFirst; arrange(); });
paint();
"""


def comparisons(run: MismatchRun, modes) -> dict[str, dict]:
    """Per (mode, training side) shown: each response token's engine and training logprob, d, the largest |d| (the
    colour scale) and each prompt's worst |d|."""
    prompt_keys = {p: k for k, p in enumerate(dict.fromkeys(run.prompts.tolist()))}
    token_prompt = np.repeat([prompt_keys[p] for p in run.prompts.tolist()], run.lengths)
    out = {}
    for mode in modes:
        engine = run.token_lp[sides.engine(mode)].astype(np.float64)
        for label, side in side_labels(run, mode).items():
            training = run.token_lp[side].astype(np.float64)
            d = engine - training
            worst = np.zeros(len(prompt_keys))
            np.maximum.at(worst, token_prompt, np.abs(d))
            out[f"vLLM {mode} vs {label}"] = dict(engine=engine.tolist(), training=training.tolist(), diff=d.tolist(),
                                                  scale=float(np.abs(d).max()) or 1.0, worst=worst.tolist())
    return out


def page(run: MismatchRun, df, advice: list[str], modes, tokenizer, title: str) -> str:
    """The report as one HTML string (see the module docstring)."""
    esc = html.escape
    rows = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row_cells(r)) + "</tr>" for _, r in df.iterrows())
    table = "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in HEADER) + "</tr>" + rows + "</table>"
    data = comparisons(run, modes)
    options = "".join(f'<option value="{esc(k)}">{esc(k)}</option>' for k in data)
    by_prompt: dict[int, list[int]] = {}
    for i, p in enumerate(run.prompts.tolist()):
        by_prompt.setdefault(p, []).append(i)
    offsets, blocks = run.offsets, []
    for k, (p, members) in enumerate(by_prompt.items()):
        first = run.sequences[members[0]]
        prompt_text = tokenizer.decode(first[: run.starts[members[0]] + 1])
        responses = []
        for i in members:
            ids = run.sequences[i][run.starts[i] + 1:]
            spans = "".join(f'<span class="tok" data-i="{offsets[i] + t}">{esc(tokenizer.decode([tok]))}</span>'
                            for t, tok in enumerate(ids))
            responses.append(f'<div class="response">{spans}</div>')
        blocks.append(f'<div class="prompt" data-k="{k}"><div><b>prompt {k + 1}</b>: {esc(prompt_text)}</div>'
                      + "".join(responses) + "</div>")
    payload = json.dumps({"comparisons": data}).replace("</", "<\\/")  # inside a <script>: no closing tag
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{STYLE}</style></head>"
            f"<body><h1>{esc(title)}</h1><p>Mismatch in nats per token, 95% intervals over prompts; change: paired, "
            f"against stock BF16 on the same tokens.</p>{table}<ul>" + "".join(f"<li>{esc(a)}</li>" for a in advice)
            + "</ul><div class='controls'><label>comparison <select id='comparison'>" + options + "</select></label> "
            "<button id='order'></button> <span>token colour: d = engine − training logprob (red: the engine higher, "
            "blue: the training side higher, white: equal bit for bit)</span></div><div id='prompts'>"
            + "".join(blocks) + f"</div><script type='application/json' id='diffs'>{payload}</script>"
            f"<script>{SCRIPT}</script></body></html>")
