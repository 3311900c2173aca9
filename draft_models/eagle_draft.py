"""An EAGLE-style draft for a chat target, and its distillation on the target's replies.

The draft (`EagleDraft`, after Li et al., EAGLE, 2024) reads, beside each token t_j, the target's
final hidden state f_{j-1} at the position before it:

    x_j = fc([embed(t_j); f_{j-1}])  ->  decoder layer(s)  ->  final norm  ->  h_j

h_j stands in for the target's own f_j: the draft's head scores the next token from it, and while
drafting a tree, a node's children read their parent's h in place of the f the target has not
computed yet. The input embeddings are the target's (frozen, not shipped); the head is the
target's tied embedding rows of the `head_vocab_size` most frequent reply tokens (FR-Spec,
frozen): a draft whose h equals f ranks those tokens exactly as the target does.

With `feature_layers` (EAGLE-3's fusion, Li et al., 2025), f_{j-1} is replaced at depth 1 by
fuse([f_{j-1}; u_{j-1}; v_{j-1}; ...]), where u, v, ... are the outputs of those target layers
(RMS-scaled): low and middle layers still hold what the last layers have reduced to the next
token. `fuse` starts as the final state alone; deeper levels read the draft's own h as before.

Training is teacher forcing on target-written replies whose f the served target computed once
(`target_states`): the loss at each reply position is smooth-L1(h_j, f_j), weighted `reg_weight`,
plus the cross-entropy between the target's next-token distribution over the draft's tokens and
the draft's. With `unroll` k > 1, pass i (2..k) feeds every position the draft's own h_{j-1}
from pass i - 1 instead of f_{j-1}, as drafting does at depth i, and adds the same loss.

The saved folder is a Hugging Face-style Llama checkpoint (specserve loads it with
`model.fc.*`, `model.fuse.weight`, `lm_head.weight`, `lm_head.token_ids`) whose config adds
`reads_target_hidden`, `draft_vocab_size`, `shares_target_embeddings` and
`target_feature_layers`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


@torch.inference_mode()
def target_states(target: str | Path, records: Sequence[dict], batch_tokens: int = 8192,
                  block_size: int = 16, cache: Path | None = None, chunk: int = 512,
                  log=print, feature_layers: Sequence[int] = ()) -> list[torch.Tensor]:
    """Per record, the served target's final (post-norm) hidden states over prompt + reply,
    float16 [len(prompt) + len(reply), H]: what the head reads and the draft imitates; with
    `feature_layers`, the outputs of those layers beside them, [.., (1 + k) H], as the engine's
    runner hands them to a draft with `target_feature_layers`.

    The target runs as specserve serves it (`load_model`: a GGUF's quantized projections on
    their own blocks, through the engine's runner), so the draft learns the very states the
    engine hands it, and the batched prefill runs several times faster than a transformers
    forward of the dequantized weights. Records go in batches of about `batch_tokens` tokens,
    each its own sequence in one forward.

    With `cache` (a folder), the states are kept there in chunks of `chunk` records, each file
    named by a digest of the target's name and the chunk's token ids: a killed run keeps the
    chunks it finished (the whole corpus takes tens of minutes), and a corpus that grew reuses
    every chunk whose records are unchanged. The states are then returned mapped from those
    files, not copied into memory: a whole corpus's states (tens of GB with tapped layers)
    outgrow the machine's memory, and training reads only a batch's records at a time."""
    from specserve.model.loader import load_model
    from specserve.model.runner import ModelRunner, Segment

    blocks = [-(-(len(r["prompt_ids"]) + len(r["reply_ids"])) // block_size) for r in records]
    runner = None

    def compute(lo: int, hi: int) -> list[torch.Tensor]:
        """The states of records[lo:hi]."""
        nonlocal runner
        if runner is None:  # loaded only once some states are not cached
            # KV for one batch, or for the longest record alone
            num_blocks = max(blocks, default=0) + batch_tokens // block_size
            runner = ModelRunner(load_model(target), num_blocks, block_size)
            runner.tap_layers(feature_layers)
        out: list[torch.Tensor] = []
        i = lo
        while i < hi:
            segments, used = [], 0  # used: KV blocks of this forward
            while i < hi and (not segments or used + blocks[i] <= batch_tokens // block_size):
                seq = records[i]["prompt_ids"] + records[i]["reply_ids"]
                segments.append(Segment(seq, range(len(seq)), 0,
                                        list(range(used, used + blocks[i])), [],
                                        hidden_rows=range(len(seq))))
                used += blocks[i]
                i += 1
            hidden: list[torch.Tensor] = []
            runner.forward(segments, hidden)
            out += [h.to(torch.float16).clone() for h in hidden]  # [len(seq), (1 + k) H]
            log(f"target states {i}/{len(records)}")
        return out

    if cache is None:
        return compute(0, len(records))
    states: list[torch.Tensor] = []
    for first in range(0, len(records), chunk):
        last = min(first + chunk, len(records))
        ids = [Path(target).name] + [[r["prompt_ids"], r["reply_ids"]]
                                     for r in records[first:last]]
        if feature_layers:  # (the final states alone keep the names they always had)
            ids.insert(1, ["layers", list(feature_layers)])
        digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
        path = Path(cache) / f"{Path(target).stem}-states-{digest}.pt"
        if path.is_file():
            log(f"target states {last}/{len(records)} (cached)")
        else:
            tmp = path.with_suffix(".tmp")  # written beside it, then renamed: never half a file
            torch.save(compute(first, last), tmp)
            tmp.replace(path)
        states += torch.load(path, mmap=True)
    return states


class EagleDraft(nn.Module):
    """Training twin of specserve's DecoderLM with `reads_target_hidden` and a reduced head."""

    def __init__(self, target: nn.Module, num_layers: int, token_ids: torch.Tensor,
                 init_layers: Sequence[int] = (), feature_layers: Sequence[int] = ()) -> None:
        from transformers import LlamaConfig, LlamaModel

        super().__init__()
        cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": num_layers})
        cfg.architectures = ["LlamaForCausalLM"]
        self.config = cfg
        H = cfg.hidden_size
        embed = target.model.embed_tokens
        self.embed_tokens = embed  # shared, frozen, not saved
        embed.requires_grad_(False)
        self.fc = nn.Linear(2 * H, H, bias=True)
        # EAGLE-3's fusion of target layers: starts as the final state alone.
        self.feature_layers = list(feature_layers)
        self.fuse = None
        if feature_layers:
            self.fuse = nn.Linear((1 + len(feature_layers)) * H, H, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, :H] = torch.eye(H)
        self.model = LlamaModel(cfg)
        self.model.embed_tokens = None  # inputs_embeds only
        for mine, src in zip(self.model.layers, init_layers):
            mine.load_state_dict(target.model.layers[src].state_dict())
        self.model.norm.load_state_dict(target.model.norm.state_dict())
        self.register_buffer("token_ids", token_ids.clone())
        head = target.lm_head.weight if target.lm_head is not None else embed.weight
        self.register_buffer("head", head[token_ids].detach().clone())  # [K, H], frozen

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                prev_hidden: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask [B, T]; prev_hidden [B, T, H] (the state before each
        token) -> h [B, T, H]."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), prev_hidden], dim=-1))
        return self.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows from `target_states` [..., (1 + k) H] -> what the draft reads in
        their place [..., H] (the engine's DecoderLM.fuse_target_features)."""
        from specserve.model.architectures import scale_taps

        if self.fuse is None:
            return rows
        return self.fuse(scale_taps(rows, self.config.hidden_size, self.config.rms_norm_eps))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K] over the draft's tokens."""
        return hidden @ self.head.T

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @staticmethod
    def saved_token_ids(folder: Path) -> torch.Tensor:
        """The head's token ids of a draft `save` wrote."""
        from safetensors import safe_open

        with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
            return f.get_tensor("lm_head.token_ids")

    def load_saved(self, folder: Path) -> None:
        """Take the trainable weights of a draft `save` wrote (its layers, norm and fc; the
        head must be the same tokens): training goes on from a shipped draft, or from a
        shallower one grown to this draft's depth."""
        from safetensors.torch import load_file

        saved = load_file(str(Path(folder) / "model.safetensors"))
        if not torch.equal(saved.pop("lm_head.token_ids"), self.token_ids):
            raise ValueError(f"{folder}: the saved draft's head has other tokens")
        saved.pop("lm_head.weight")
        self.fc.weight.data.copy_(saved.pop("model.fc.weight"))
        self.fc.bias.data.copy_(saved.pop("model.fc.bias"))
        # A draft of the final state alone can grow feature layers (its fuse starts as that
        # state alone); the other way round would drop what the saved one learned.
        fuse = saved.pop("model.fuse.weight", None)
        if fuse is not None:
            if self.fuse is None or fuse.shape != self.fuse.weight.shape:
                raise ValueError(f"{folder}: the saved draft reads other target layers")
            self.fuse.weight.data.copy_(fuse)
        theirs = {k.removeprefix("model."): v for k, v in saved.items()}
        saved_layers = 1 + max((int(k.split(".")[1]) for k in theirs if k.startswith("layers.")),
                               default=-1)
        # A draft can grow deeper than the saved one: its layers past the saved ones start as
        # the identity (their attention and MLP outputs zeroed: the residual stream passes
        # through), so the grown draft begins by computing what the saved one did.
        grown = range(saved_layers, len(self.model.layers))
        mine = {k: v for k, v in self.model.state_dict().items() if "rotary_emb" not in k
                and not any(k.startswith(f"layers.{i}.") for i in grown)}
        if mine.keys() != theirs.keys():
            raise ValueError(f"{folder}: the saved draft's layers differ from this one's "
                             f"({sorted(theirs.keys() ^ mine.keys())[:4]})")
        self.model.load_state_dict(theirs, strict=False)
        with torch.no_grad():
            for i in grown:
                self.model.layers[i].self_attn.o_proj.weight.zero_()
                self.model.layers[i].mlp.down_proj.weight.zero_()

    def save(self, out: Path, extra_config: dict, dtype: torch.dtype = torch.bfloat16) -> None:
        """Safetensors without the embeddings; config.json naming the draft's kind."""
        out.mkdir(parents=True, exist_ok=True)
        state = {f"model.{k}": v for k, v in self.model.state_dict().items()
                 if "rotary_emb" not in k}
        state["model.fc.weight"] = self.fc.weight
        state["model.fc.bias"] = self.fc.bias
        if self.fuse is not None:
            state["model.fuse.weight"] = self.fuse.weight
            extra_config = {**extra_config, "target_feature_layers": self.feature_layers}
        state["lm_head.weight"] = self.head
        state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
        state["lm_head.token_ids"] = self.token_ids.clone()
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        cfg = self.config.to_dict()
        cfg.update(tie_word_embeddings=False, dtype=str(dtype).removeprefix("torch."),
                   draft_vocab_size=len(self.token_ids), shares_target_embeddings=True,
                   reads_target_hidden=True, **extra_config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def state_batches(records: Sequence[dict], states: Sequence[torch.Tensor], batch_size: int,
                  seed: int, length_window: int = 1) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless shuffled batches: ids, attention mask [B, T]; prev [B, T, W] (f_{j-1}, zeros at
    j = 0 and in padding); f [B, T, W]; loss mask [B, T] (positions predicting reply tokens).
    W = (1 + k) H: the states' width (the final state, then k tapped layers' outputs).

    With `length_window` > 1, each run of `length_window` batches' worth of shuffled records is
    sorted by length, cut into batches, and those batches are shuffled: a batch's records are of
    similar lengths, so a batch pads far less. (The corpus's records run from about 100 to 1000
    tokens: batches of 8 drawn at random pad to 1.8x their tokens and 2.9x their attention's
    work.) Every record is still seen once per pass, in an order that changes with each pass."""
    if length_window < 1:
        raise ValueError(f"length_window {length_window}: expected 1 or more batches")
    rng = random.Random(seed)
    order = list(range(len(records)))
    W = states[0].shape[-1]
    lengths = [len(r["prompt_ids"]) + len(r["reply_ids"]) for r in records]
    window = length_window * batch_size
    while True:
        rng.shuffle(order)
        picks = []
        for w in range(0, len(order) - batch_size + 1, window):
            run = order[w:w + window]
            # (a window of one batch neither sorts nor shuffles: --length-window 1 gives the very
            # batches, row order included, that training drew before windows)
            if length_window > 1:
                run = sorted(run, key=lambda j: lengths[j])
            picks += [run[i:i + batch_size] for i in range(0, len(run) - batch_size + 1,
                                                          batch_size)]
        if length_window > 1:
            rng.shuffle(picks)
        for picked in picks:
            yield _batch(records, states, picked, W)


def _batch(records: Sequence[dict], states: Sequence[torch.Tensor], picked: Sequence[int],
           W: int) -> tuple[torch.Tensor, ...]:
    """One batch of state_batches: the records `picked`, padded to the longest."""
    seqs = [records[j]["prompt_ids"] + records[j]["reply_ids"] for j in picked]
    width = max(map(len, seqs))
    ids = torch.zeros(len(picked), width, dtype=torch.long)
    mask = torch.zeros(len(picked), width, dtype=torch.long)
    f = torch.zeros(len(picked), width, W)
    loss_mask = torch.zeros(len(picked), width, dtype=torch.bool)
    for b, (j, seq) in enumerate(zip(picked, seqs)):
        n = len(seq)
        ids[b, :n] = torch.tensor(seq)
        mask[b, :n] = 1
        f[b, :n] = states[j].float()
        # f_j predicts token j + 1: the reply's tokens are predicted from the last prompt
        # position to the second-to-last reply position.
        loss_mask[b, len(records[j]["prompt_ids"]) - 1:n - 1] = True
    prev = torch.cat([torch.zeros(len(picked), 1, W), f[:, :-1]], dim=1)
    return ids, mask, prev, f, loss_mask


def eagle_loss(draft: EagleDraft, batch: tuple[torch.Tensor, ...], unroll: int,
               cls_weight: float, reg_weight: float = 1.0,
               measure_agreement: bool = True) -> tuple[torch.Tensor, list[float]]:
    """The loss summed over `unroll` passes, and each pass's top-1 agreement with the target
    (with `measure_agreement`, else []: the maxima over [P, K] rows it takes are about 5% of a
    training step, and the recipe logs them only every 20 steps).

    reg_weight 0 drops the hidden-state regression (EAGLE-3's choice): h is then shaped only by
    the next-token loss, here and through the later passes that read it."""
    ids, mask, prev, f, loss_mask = batch
    f_at = f[loss_mask][:, :draft.config.hidden_size]  # [P, H]: the final states
    prev = draft.features(prev)  # [B, T, H]
    target_p = torch.softmax(draft.logits(f_at), dim=-1)  # [P, K]: the target over K tokens
    # (max's indices: argmax over these [P, K] rows took about 2x as long in float32 and
    # 2.5x in bf16 on a Sapphire Rapids class CPU)
    target_top = target_p.max(-1).indices if measure_agreement else None
    total, agreement = 0.0, []
    for _ in range(unroll):
        h = draft(ids, mask, prev)  # [B, T, H]
        h_at = h[loss_mask]  # [P, H]
        logits = draft.logits(h_at)
        ce = -(target_p * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + reg_weight * F.smooth_l1_loss(h_at, f_at) + cls_weight * ce
        if measure_agreement:
            agreement.append((logits.detach().max(-1).indices == target_top).float().mean().item())
        # The next pass reads the draft's own states, as drafting one level deeper does.
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1].detach()], dim=1)
    return total / unroll, agreement


@torch.inference_mode()
def agreement(draft: EagleDraft, records: Sequence[dict], states: Sequence[torch.Tensor],
              depth: int = 3) -> list[float]:
    """Top-1 agreement with the target's greedy reply tokens on held-out records at drafting
    depth 1..`depth` (depth d reads the draft's own states d - 1 times over)."""
    hits, total = [0] * depth, 0
    for r, s in zip(records, states):
        seq = r["prompt_ids"] + r["reply_ids"]
        ids = torch.tensor([seq[:-1]])
        f = s[:-1].float()[None]  # [1, T, (1 + k) H]
        prev = draft.features(torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1))
        first = len(r["prompt_ids"]) - 1
        want = torch.tensor(r["reply_ids"])
        for d in range(depth):
            h = draft(ids, torch.ones_like(ids), prev)
            pred = draft.token_ids[draft.logits(h[0, first:]).argmax(-1)]
            hits[d] += int((pred == want).sum())
            prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        total += len(want)
    return [x / max(1, total) for x in hits]
