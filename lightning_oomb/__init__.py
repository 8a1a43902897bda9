"""lightning_oomb"""
