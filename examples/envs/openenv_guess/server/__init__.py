"""Guess environment server components."""
