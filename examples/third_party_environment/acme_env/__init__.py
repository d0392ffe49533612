"""acme-env: a third-party drivetrain environment (``env=acme_lookup``)."""
