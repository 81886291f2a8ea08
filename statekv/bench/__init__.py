"""``statekv bench``: load tests of the service, measured the way serving engines measure theirs.

``statekv bench serve`` (`command`) drives a running ``statekv serve`` over its HTTP routes, or one it starts
itself (`server`), with N simulated cameras pushing frames in real time and questions arriving per stream
(`load`), and reports per N what a buyer of cameras asks: frames per second, lag behind real time, time to the
first answer token, the streams held at real time under a latency target (`summary`).
"""
