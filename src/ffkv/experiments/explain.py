"""Explain one prediction layer by layer: what the residual, the FFN and its top memories say."""
from __future__ import annotations

import torch

from ffkv.errors import FfkvError


@torch.no_grad()
def explain(mm, text: str, top_memories: int = 3) -> dict:
    ids = mm.tok(text, add_special_tokens=True)["input_ids"][: mm.max_length]
    if not ids:
        raise FfkvError("the text is empty after tokenization")
    inp, mask = mm.batch([ids])
    cap = mm.capture(inp, mask, what=("r", "m", "y", "o"), logits=True)
    w = int(cap.logits[0, -1].argmax())
    lens = mm.lens
    tok = lambda i: mm.tok.decode([int(i)])  # noqa: E731
    rows = []
    for l in range(mm.n_layers):
        c = cap[l]
        r, y, o, m = c["r"][0, -1], c["y"][0, -1], c["o"][0, -1], c["m"][0, -1]
        # contribution of memory i to the final token's logit, read through the lens direction
        contrib = m * lens.direction_logits(mm.values(l), torch.tensor([w]))[:, 0]
        best = contrib.topk(top_memories).indices.tolist()
        rows.append({
            "layer": l,
            "top_r": tok(lens.top(r)), "top_y": tok(lens.top(y)), "top_o": tok(lens.top(o)),
            "p_final_in_r": float(lens.probs(r)[w]),
            "memories": [{"dim": i, "coef": float(m[i]), "contrib": float(contrib[i]),
                          "value_top": tok(lens.direction_logits(mm.values(l)[i] * m[i].sign()).argmax())}
                         for i in best],
        })
    return {"text": text, "prediction": tok(w), "prediction_id": w,
            "p": float(torch.softmax(cap.logits[0, -1].float(), -1)[w]), "layers": rows}
