"""PageStoreActor: one per node, detached, no CPU. Writes the CPU bit-planes of a checkpoint once into
/dev/shm (pagedweight.page_store) so every engine of the node maps the same physical pages.

The store outlives engine restarts: a restarted engine rebuilds its GPU state from it instead of
re-reading the checkpoint. Stores are keyed by the checkpoint's planes checksum, so two
checkpoints never share one and a re-quantized checkpoint gets a fresh store. The store is named as the engine
names it by default, so an engine started without Ray on the same node maps the same pages.
"""
from __future__ import annotations

import os
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "pagedweight"
DEFAULT_ROOT = "/dev/shm"


@ray.remote(num_cpus=0)
class PageStoreActor:
    """Owns the node's page stores: creates each once, hands out its path, removes them on `destroy`."""

    def __init__(self, root: str = DEFAULT_ROOT):
        self._root = Path(root)
        self._stores: dict[str, str] = {}  # model dir -> path of the store of its current planes
        self._written: set[str] = set()  # every store this actor wrote (`destroy` removes them)

    def ensure(self, model_dir: str) -> str | None:
        """Path of the store holding `model_dir`'s planes, written on first request; None for a dense
        (non any-precision) checkpoint, which has no planes to share. The manifest is read on every call (the
        store's name comes from its planes): a checkpoint re-quantized in the same directory gets a fresh store."""
        from pagedweight.apformat import MANIFEST, load_ap
        from pagedweight.runner import ap_weights, default_store_dir

        model_dir = str(Path(model_dir).resolve())
        if not (Path(model_dir) / MANIFEST).is_file():
            return None
        ap = load_ap(model_dir, verify=False)
        path = str(default_store_dir(ap, self._root))  # the engine's own default name
        if path not in self._written:
            ap_weights(ap, Path(path)).store.close()  # creates the store once (file-locked) and checks it opens
            self._written.add(path)
        self._stores[model_dir] = path
        return path

    def stores(self) -> dict[str, str]:
        return dict(self._stores)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def destroy(self) -> int:
        """Remove every store this actor wrote (engines still mapping one keep their pages)."""
        from pagedweight.page_store import PageStore

        for path in self._written:
            if os.path.exists(path):
                PageStore.destroy(path)
        removed, self._stores, self._written = len(self._written), {}, set()
        return removed


def page_store_name(node_id: str) -> str:
    return f"pagedweight-page-store-{node_id}"


def page_store_for_node(node_id: str | None = None, root: str = DEFAULT_ROOT):
    """The page store actor of `node_id` (default: the caller's node), created detached on first use."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return PageStoreActor.options(
        name=page_store_name(node_id), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(root)
