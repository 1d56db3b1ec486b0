"""Arrow to torch: values and list levels (numpy), tensors, padded batches, gathering; tokenizers."""
