"""The KV memory a rank copies, as regions of block pages: a layout
descriptor, the engines' layouts, the block geometry a rank announces, and
how memory crosses processes (manifests, shared-memory files, which cache a
resume may attach).  Torch where tensors are made; no sockets."""
