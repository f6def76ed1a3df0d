"""Audits of the papers' claims (``vitexp-audit``)."""
