"""The Board: the human's pages, with their templates and static files as package data."""
