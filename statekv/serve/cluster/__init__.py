"""``statekv serve`` on a Ray cluster: the same service as several replicas behind Ray Serve, over one shared state
folder (see docs/serving.md, "On a Ray cluster").

Modules: `leases` (which replica holds each stream, with a fencing token), `shared` (a replica's stream files and
registry over the shared folder), `board` (each replica's metrics and whereabouts, ``GET /metrics`` for all),
`hosting` (how a replica holds its streams: the service's `Hosting` for it), `router` (Ray Serve's request router:
each stream's requests to its replica, new streams to the least-loaded), `scaling` (autoscaling on streams),
`deployment` (the Ray Serve deployment and its options), `launch` (``statekv serve --ray``).
"""
