"""Does this target serve correctly, and does this draft fit it? Pure checks on capabilities;
every problem is a sentence saying what differs and what would fit."""
from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import Message

from dflash.v1 import draft_pb2, target_pb2

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Decision:
    problems: list[str] = field(default_factory=list)   # non-empty: refuse (NOT_SERVING)
    notes: list[str] = field(default_factory=list)      # adjustments worth a log line
    block_size: int = 1                                  # default verify block (anchor + drafts)
    max_block_size: int = 1
    tree_nodes: int = 0                                  # requests' fixed tree size (0 = chains)
    max_tree_nodes: int = 0                              # the largest tree both sides take

    @property
    def ok(self) -> bool:
        return not self.problems


def check_target(caps: target_pb2.TargetCapabilities, local_tokenizer_hash: str) -> list[str]:
    """Problems that make the target unusable, with or without a draft."""
    problems = []
    if caps.protocol_version != PROTOCOL_VERSION:
        problems.append(f"target speaks protocol version {caps.protocol_version}; "
                        f"this gateway speaks {PROTOCOL_VERSION}")
    if caps.hybrid and not caps.mamba_verify_commit:
        problems.append(f"target {caps.model_id!r} is hybrid (recurrent layers) but its attention "
                        f"backend {caps.attention_backend!r} cannot commit recurrent state after "
                        f"verify (mamba_verify_commit=false): its outputs would be wrong; start it "
                        f"with a backend that commits")
    if caps.tokenizer_hash and local_tokenizer_hash and caps.tokenizer_hash != local_tokenizer_hash:
        problems.append(f"the gateway's tokenizer (sha256 {local_tokenizer_hash[:12]}) is not the "
                        f"target's ({caps.tokenizer_hash[:12]}): pass --tokenizer with the target's "
                        f"model directory")
    if caps.max_block_size < 1:
        problems.append("target reports max_block_size 0: it cannot verify")
    return problems


def check_pair(target: target_pb2.TargetCapabilities, draft: draft_pb2.DraftCapabilities,
               requested_block: int, requested_tree: int = 0) -> Decision:
    """Draft vs target. The block size is the requested one, else the draft's trained one,
    clamped to what both sides allow; so is the tree size (0 where either side has no trees)."""
    problems = _pair_problems(target, draft)
    max_block = min(target.max_block_size, draft.max_block_size or target.max_block_size)
    block = requested_block or draft.block_size or max_block
    notes = []
    if block > max_block:
        notes.append(f"block size {block} clamped to {max_block} (target max_block_size "
                     f"{target.max_block_size}, draft max_block_size {draft.max_block_size})")
        block = max_block
    max_tree = min(target.max_tree_nodes, draft.max_tree_nodes)
    tree = min(requested_tree, max_tree)
    if tree < requested_tree:
        notes.append(f"tree of {requested_tree} drafts clamped to {tree} (target max_tree_nodes "
                     f"{target.max_tree_nodes}, draft max_tree_nodes {draft.max_tree_nodes}; "
                     f"0 = chains)")
    return Decision(problems, notes, max(1, block), max(1, max_block), tree, max_tree)


def autoregressive(target: target_pb2.TargetCapabilities) -> Decision:
    return Decision(block_size=1, max_block_size=max(1, target.max_block_size))


# what replicas of one role must agree on (a request may move between them mid-stream)
TARGET_IDENTITY = ("model_id", "architecture", "dtype", "kv_dtype", "vocab_size", "num_layers",
                   "hidden_size",
                   "tokenizer_hash", "eos_token_ids", "max_context", "max_block_size",
                   "max_tree_nodes", "hybrid", "feature_dtypes", "protocol_version")
DRAFT_IDENTITY = ("model_id", "drafter_kind", "block_size", "max_block_size", "max_tree_nodes",
                  "needs_features", "target_layer_ids", "feature_dtype", "hidden_size",
                  "mask_token_id", "target", "protocol_version")


def replica_differs(reference, caps, fields: tuple[str, ...]) -> str:
    """Why a replica's capabilities differ from the reference replica's of its role ("" when
    they agree on every field that matters)."""
    diffs = [f"{name} {_shown(getattr(caps, name))} (the others: "
             f"{_shown(getattr(reference, name))})"
             for name in fields if getattr(caps, name) != getattr(reference, name)]
    return "; ".join(diffs)


def _shown(value) -> str:
    """A capability's value in a log line: a message by its set fields, a repeated field as a
    list, a scalar as itself."""
    if isinstance(value, Message):
        return "{" + ", ".join(f"{f.name}={v!r}" for f, v in value.ListFields()) + "}"
    if isinstance(value, (str, bytes, int, float, bool)):
        return repr(value)
    return repr(list(value))


def _pair_problems(t: target_pb2.TargetCapabilities, d: draft_pb2.DraftCapabilities) -> list[str]:
    p = []
    if d.protocol_version != PROTOCOL_VERSION:
        p.append(f"draft speaks protocol version {d.protocol_version}; this gateway speaks "
                 f"{PROTOCOL_VERSION}")
    fp = d.target
    if fp.vocab_size and fp.vocab_size != t.vocab_size:
        p.append(f"draft was made for a vocabulary of {fp.vocab_size} tokens; the target has "
                 f"{t.vocab_size}")
    if fp.num_layers and fp.num_layers != t.num_layers:
        p.append(f"draft was made for a target of {fp.num_layers} layers; this one has "
                 f"{t.num_layers}")
    if fp.tokenizer_hash and t.tokenizer_hash and fp.tokenizer_hash != t.tokenizer_hash:
        p.append(f"draft was made for tokenizer {fp.tokenizer_hash[:12]}; the target's is "
                 f"{t.tokenizer_hash[:12]}")
    hidden = d.hidden_size or fp.hidden_size
    if d.needs_features and hidden != t.hidden_size:
        p.append(f"draft reads features of hidden size {hidden}; the target's hidden size is "
                 f"{t.hidden_size}")
    bad = [i for i in d.target_layer_ids if i >= t.num_layers]
    if bad:
        p.append(f"draft taps target layers {list(d.target_layer_ids)}; ids {bad} are outside the "
                 f"target's layers [0, {t.num_layers})")
    if d.needs_features and not d.target_layer_ids:
        p.append("draft needs features but names no target layers to tap")
    if d.needs_features and d.feature_dtype and d.feature_dtype not in t.feature_dtypes:
        p.append(f"draft wants features as {d.feature_dtype}; the target sends "
                 f"{list(t.feature_dtypes)}")
    if d.mask_token_id >= t.vocab_size:
        p.append(f"draft mask token id {d.mask_token_id} is outside the target's vocabulary "
                 f"[0, {t.vocab_size})")
    return p
