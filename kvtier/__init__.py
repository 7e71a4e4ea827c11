"""kvtier: the command-line front end over engine, kvstore and connector."""
