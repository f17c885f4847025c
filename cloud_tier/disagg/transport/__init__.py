"""KV transport: moves one request's KV payload from a prefill worker to a decode worker.

Contract. ``KVSender.send(address, header, payload)`` moves one contiguous payload and the
`TransferHeader` describing it to the `KVReceiver` at ``address`` and returns that receiver's
`TransferAck`. The receiver takes only a transfer it expects (``KVReceiver.expect``: the request
id, the token the header must carry, a cap on its bytes), checked from the header before
anything is allocated, and validates it completely (header, length, checksum) before
its handler sees the payload, and the handler's ack goes back to the sender. A truncated or
corrupt transfer never reaches the handler: the receiver answers ok=False with code "truncated"
or "corrupt" when the connection still allows it. Any other outcome the sender cannot know (the
receiver unreachable, the connection dropped, no ack within ``timeout_s``) raises
`TransferError`: the KV may or may not have been adopted.

Two transports, one receiver. ``tcp`` sends the header frame then the raw payload on one
connection per transfer. ``shm`` (same host) copies the payload once into a shared-memory
segment the sender owns and always unlinks, and sends only the header over TCP.

    receiver = KVReceiver(adopt, model_identity="smollm2-135m/bfloat16")
    await receiver.start()
    receiver.expect("req-1", token, max_nbytes=kv.nbytes)  # header: request_id="req-1", token=token
    ack = await TcpSender().send(receiver.address, header, tensor_payload(kv))
"""

from cloud_tier.disagg.transport.base import (
    CHUNK,
    Handler,
    KVSender,
    TransferError,
    payload_to_tensor,
    tensor_payload,
)
from cloud_tier.disagg.transport.receiver import KVReceiver, ReceiverLimits
from cloud_tier.disagg.transport.shm import ShmSender
from cloud_tier.disagg.transport.tcp import TcpSender

__all__ = ["CHUNK", "Handler", "KVReceiver", "KVSender", "ReceiverLimits", "ShmSender", "TcpSender",
           "TransferError", "payload_to_tensor", "tensor_payload"]
