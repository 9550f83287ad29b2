"""Identities, signatures, commitments, verification, bans and input limits (no networking)."""
