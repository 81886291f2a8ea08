"""``statekv serve`` on a Ray cluster: the same service as several replicas behind Ray Serve, sharing their state
through one folder every node mounts or through an object store alone (see docs/serving.md, "On a Ray cluster").

Modules: `shared` (`LeasedPlacement`: a replica's placement, streams taken when asked for, handed over, balanced),
over a shared folder: `leases` (which replica holds each stream, with a fencing token, under POSIX locks) and
`folder` (a replica's files there); over an object store: `objects` (the store through fsspec, its conditional
create), `versions` (each stream's chain of versions, fenced by that create), `sessions` (how long a replica's
hold lasts) and `store_files` (a replica's files there, keys); `board` (each replica's metrics and whereabouts,
``GET /metrics`` for all),
`hosting` (how a replica holds its streams: the service's `Hosting` for it), `router` (Ray Serve's request router:
each stream's requests to its replica, new streams to the least-loaded), `scaling` (autoscaling on streams),
`deployment` (the Ray Serve deployment and its options), `launch` (``statekv serve --ray``).
"""
