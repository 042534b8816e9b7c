"""Aliases: names an organisation moves between its models (`POST/GET/DELETE /v1/aliases`)."""
