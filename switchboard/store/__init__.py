"""The store: transaction bodies over one connection type, with no HTTP in them. Each module takes a `Txn`
(database.py) and returns plain data; this is the seam another storage engine would plug into."""
