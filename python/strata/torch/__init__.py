"""strata for PyTorch: models larger than memory, their weights streamed from safetensors.

::

    import strata.torch as st
    model = st.load_model("path/to/checkpoint", device="cpu", device_budget="2GiB",
                          host_budget="4GiB")            # a transformers model, ready
    logits = model(input_ids).logits
    ids = model.generate(input_ids, max_new_tokens=32)
    st.offload(module, checkpoint="weights.safetensors", device="cpu")  # any nn.Module
    opt = st.optim.AdamW(model.parameters(), lr=1e-3, offload="nvme", nvme_dir="/mnt/nvme0")
    model, opt = st.train.offload(model, lr=1e-4, device_budget="2GiB", nvme_dir="/mnt/nvme0")
    cache = st.KVCache(model, host_budget="4GiB", nvme_dir="/mnt/nvme0")  # KV on the tiers
    ids = model.generate(input_ids, cache=cache, max_new_tokens=512)

Every parameter stays in its file (mapped in place, read with O_DIRECT) until its block runs;
the prefetch pipeline brings the next blocks while the current one computes. See the README's
section "Run a Hugging Face model larger than memory".
"""

from . import optim, train
from ._activations import ActivationOffload, offload_activations
from ._checkpoint import checkpoint_files, map_checkpoint
from ._kvcache import KVCache
from ._load import load_model, parameters_on_meta
from ._offload import Block, Offloaded, find_blocks, offload
from ._runtimes import make_runtime
from ._zero import DistributedError

__all__ = [
    "ActivationOffload",
    "Block",
    "DistributedError",
    "KVCache",
    "Offloaded",
    "checkpoint_files",
    "find_blocks",
    "load_model",
    "make_runtime",
    "map_checkpoint",
    "offload",
    "offload_activations",
    "optim",
    "parameters_on_meta",
    "train",
]
