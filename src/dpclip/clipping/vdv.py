"""(placeholder: strategies are registered here at import)"""
