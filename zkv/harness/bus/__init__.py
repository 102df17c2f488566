"""The bus as local processes (a broker and rank workers, ``zkv up``), and what
measures it beside a same-run baseline."""
