"""The stream classes (ParquetStream, BlendedStream, PackedStream), their shared pass model, the one delivery path, and ElasticSampler for map-style datasets."""
