"""The runtime executes a layer plan: device slots, the transports that load a block into a
slot (host-to-device, AllGather, copy-engine gather, staged), the ring, the guard shared by
the ring and the model swap, and the bandwidth probes.
"""
