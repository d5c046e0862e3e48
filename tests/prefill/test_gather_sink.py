"""``GatherSink`` (a tensor-parallel prefill worker with split KV heads): at finish it gathers the request's pages
into staging pages and ships them whole; with decode-side reuse only the pages after the decode worker's resident
prefix are gathered and shipped. The end-to-end path (real ranks) is tests/integration/test_serve_tp.py's."""
import pytest

from engine.kvcache import KVComponent, KVLayout, KVPool
from prefill.gather_sink import GatherSink
from prefill.sink import KVSink, SinkResult, resolved

PAGE, LAYERS = 4, 3


class Recorder(KVSink):
    """The inner sink (``TransferSink`` in a worker): what it was asked to ship."""

    def __init__(self) -> None:
        self.calls = []

    def start(self, pages, cached_len):
        self.calls.append(("start", list(pages), cached_len))

    def send(self, layer, token_start, token_end):
        self.calls.append(("send", layer, token_start, token_end))

    def finish(self, draft=None):
        self.calls.append(("finish",))
        return resolved(SinkResult(1, 0.0))

    def abort(self, reason):
        self.calls.append(("abort", reason))


@pytest.mark.parametrize("skip", [0, 2 * PAGE])
def test_gathers_and_ships_only_the_pages_after_the_resident_prefix(skip):
    layout = KVLayout("glm4_moe", LAYERS, PAGE, "float32", (KVComponent("k", (1, 4)), KVComponent("v", (1, 4))))
    pool, staging = KVPool(layout, 16), KVPool(layout, 8)
    prompt_len = 5 * PAGE + 1
    pages = pool.allocator.alloc(pool.pages_for(prompt_len), "req")
    gathered, inner = [], Recorder()
    sink = GatherSink(inner, lambda src, dst: gathered.append((list(src), list(dst))), staging, LAYERS,
                      prompt_len - skip, "req", skip)
    sink.start(pages, 0)
    sink.send(0, 0, prompt_len)  # a no-op: everything ships at finish
    assert sink.finish().result().num_bytes == 1
    [(src, dst)] = gathered
    assert src == pages[skip // PAGE:] and len(dst) == staging.pages_for(prompt_len - skip)
    assert inner.calls == [("start", dst, 0), *[("send", layer, 0, prompt_len - skip) for layer in range(LAYERS)],
                           ("finish",)]
    assert staging.allocator.num_used == 0  # the staging pages are freed once the receiver acknowledged
