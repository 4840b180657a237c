"""The stage workers (one module per stage), the process runtime they share, and the CLI."""
