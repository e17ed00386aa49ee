"""The feature dtypes the wire carries (TensorData.dtype, FeatureRef.dtype), by name, with their
sizes in bytes. Torch-free: the gateway sizes feature chunks without importing torch
(services/common/tensor_codec.py maps the names to torch dtypes for the model services)."""
from __future__ import annotations

ITEM_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
