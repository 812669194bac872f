"""KV handoff from prefill to decode workers: handle, source (prefill side), transports, sink."""

from tandem.kvcache.transfer.base import KVLayout, KVTransferError, KVTransferHandle, KVTransport

__all__ = ["KVLayout", "KVTransferError", "KVTransferHandle", "KVTransport"]
