"""The recipe of one drafter training run (`dflash train-draft` fills it from its flags)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainConfig:
    target_dir: str
    out_dir: str
    num_layers: int = 2
    intermediate_size: int = 0                 # the drafter's FFN width (0 = the target's)
    layer_passes: int = 1                      # > 1: the block runs the layers this many times
                                               # with the same weights (dflash_config.layer_passes)
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = ()     # () = num_taps spread by DFlash's rule
    num_taps: int = 5
    mask_token_id: int = 0
    steps: int = 2000
    batch_sequences: int = 16
    blocks_per_sequence: int = 32
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    reach_weight: float = 0.0                  # in [0, 1]: scale position k by its reach (blocks.py)
    anchor_window: int = 0                     # > 0: anchors only in the first N answer tokens
    loop_hops: int = 0                         # > 0: move each anchor this many speculative-loop
                                               # steps of the drafter itself (blocks.hop_anchors)
    max_len: int = 768
    eval_every: int = 250
    eval_sequences: int = 64
    seed: int = 0
    greedy_labels: bool = True                 # labels: the target's greedy chain (see blocks.py)
    soft_label_weight: float = 0.0             # > 0: + this x KL(target || draft) (blocks.py)
    cache_features: bool = False               # compute all features once, keep them on device
    init_from: str = ""                        # start from this drafter's weights (same shape)
    init_from_target: bool = False             # start the layers from the target's last ones
    checkpoint: str = ""                       # resume from / save to this file ("" = none)
    stop_after_seconds: float = 0.0            # > 0: save the checkpoint and stop after this
    device: str = "cuda"
    feature_backend: str = "triton"
    extra: dict = field(default_factory=dict)
