"""Observability: the sans-IO metric books the broker and ranks keep
(``book``), their Prometheus export (``prometheus``), the status table
(``status_view``) and the trace / bench pictures (``plots``).  Importing this
package loads none of them."""
