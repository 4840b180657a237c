"""Everything that knows NATS: connection, names, streams, the consumer loop, replies, cancels.

No other package imports `nats`; stages see typed models and the small objects defined here.
"""
