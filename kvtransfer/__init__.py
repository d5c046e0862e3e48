"""pdserve kvtransfer: the KV data plane between a prefill worker and a decode worker.

A transfer, end to end (decode side states: ``TransferState``; prefill side: ``SendState``)::

    decode  receiver.reserve(req_id, n)        RESERVED   pages allocated, generation counters noted;
                                                          NO_CAPACITY raises here, nothing allocated
            ticket.to_dict() -> router -> prefill worker
    prefill sender.open(ticket)  (optional)    QUEUED     before the forward: connect; over shm ask for the
                                                          lease now (its round trip overlaps the compute)
            sender.send_layer(ticket, l, ...)  QUEUED     source pages pinned, frame queued (non-blocking)
            [connect, mutual HMAC, layout check]          once per receiver; wrong secret / layout -> error
            LAYER frame (TCP) or shm copy      STREAMING  each layer as soon as it is computed
    decode  frame accepted                     RECEIVING  request, pages, generations, size, order,
                                                          checksum (XXH3 trailer)
                                                          checked; bytes land in the reserved pages
    prefill sender.finish(ticket, draft)       FINISHING  FINISH frame (with the MTP draft state when the
                                                          ticket's ``DraftLayout`` asks: a speculating decode)
    decode  every layer x token verified       COMPLETE   DONE frame back to the sender; the draft state
                                                          (size, checksum) rides on ``TransferResult.draft``
            await receiver.wait_complete()     CLAIMED    pages now owned by the decode request
    prefill DONE received                      DONE       source pages unpinned

    Any failure (expiry, stall, timeout, checksum, stale page, peer death, cancel on either
    side) -> FAILED on both sides with the same ``FailReason``; the decode pages are freed
    (after DRAINING if a shm writer may still touch them) and the prefill pages unpinned.

Modules: ``config`` (frozen configs, the env var), ``protocol`` (frames, limits, versions),
``auth`` (HMAC), ``ticket`` (tickets, reservations), ``payload`` (rows <-> bytes), ``framing``
(socket I/O), ``rx_conn``/``receiver`` (decode side), ``tx_state`` (send states), ``frame_writer``
(frames onto a socket), ``tx_peer`` (one connection), ``sender`` (prefill side), ``shm`` (shared-memory
pool), ``admission`` (connection budgets on the KV port), ``loop`` (event loop thread).
"""
import importlib

_EXPORTS = {
    "config": ("ChecksumKind", "DraftLayout", "KVReceiverConfig", "KVSenderConfig", "TransportKind", "WireDType"),
    "errors": ("FailReason", "TransferError"),
    "loop": ("LoopThread",),
    "protocol": ("PDSERVE_KV_PROTOCOL_VERSION",),
    "receiver": ("KVReceiver", "ReceiverStats"),
    "sender": ("KVSender", "LayerSend", "LayerSends"),
    "shm": ("ShmKVPool",),
    "ticket": ("TransferResult", "TransferState", "TransferTicket"),
    "tx_state": ("SendResult", "SendState"),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    """``from kvtransfer import KVSender`` loads ``kvtransfer.sender`` then: the package itself stays light, so
    ``kvtransfer.config`` (what ``pdserve serve`` / ``launch`` parse flags with) never pulls in torch."""
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvtransfer.{mod}"), name)
    globals()[name] = value
    return value
