from ffkv.cli import main

main()
