"""Offline tools that are not part of the serving runtime: the random-weight checkpoint writer
(tests and benches) and the probe model's data, training and reference evaluation. The runtime
(engine, kvcache, attention, models, layers, server) never imports this package."""
