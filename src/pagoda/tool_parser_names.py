"""The `--tool-call-parser` names, apart from the parsers: the CLI offers them without importing the server.

`pagoda.server.tool_parsers` registers one parser under each name and checks at import that the two agree.
"""

TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")
