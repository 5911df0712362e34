"""Real text for the quality measurement: ordinary prose, a few hundred tokens each.

``CALIBRATION_TEXTS`` (``CALIBRATION_TEXT`` and ``CALIBRATION_MORE``, ~2,300 tokens) give the E8
codec its key means and key transforms; the ``PROMPTS`` are what quality is measured on, so
nothing is calibrated on what it is judged by.
``QUESTIONS`` are short chat questions whose greedy answers, fp32 against a codec, are compared.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_MORE", "CALIBRATION_TEXT", "CALIBRATION_TEXTS", "PROMPTS", "QUESTIONS"]

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Why do leaves change colour in autumn?",
    "How many days are there in a leap year?",
    "What does a baker do in the morning?",
    "Explain in one sentence what a harbour is.",
)

CALIBRATION_TEXT = """\
The harbour town wakes before the sun does. By five o'clock the bakers have already pulled the \
first trays of bread from their ovens, and the smell drifts down the narrow streets toward the \
water, where the fishing boats are coming back in with their nets folded on the decks. The \
fishermen do not talk much at that hour. They tie up, hand their crates to the men from the \
market, and stand for a while with their hands around paper cups of coffee, watching the light \
come up over the breakwater. Later in the morning the tourists arrive on the ferry from the \
mainland, with their cameras and their maps, and the town changes its face: the cafes put out \
their chairs, the shops raise their shutters, and the old women who sell lace set up their \
tables in the square. Most visitors stay only a day. They walk up the hill to the church, buy \
a postcard, eat grilled sardines at one of the restaurants by the quay, and catch the last \
ferry home. The few who stay longer discover a different place, quieter and slower, where the \
evenings are long and the conversations in the bars go on until the lights of the boats are \
the only thing left to look at on the water.
"""

CALIBRATION_MORE: tuple[str, ...] = (
    """\
The path to the upper lake leaves the village behind the sawmill and climbs through a forest \
of spruce and larch for the first two hours. It is a good path, wide and well drained, built \
long ago by the people who drove their cattle up to the summer pastures, and in places you can \
still see the flat stones they laid across the wettest ground. Above the tree line the country \
opens out. The grass is short and full of small flowers, blue gentians and yellow globe \
flowers and a pale orchid whose name I never manage to remember, and the marmots sit up on \
their rocks and whistle at you as you pass. We stopped at the old herders' hut to eat our \
lunch. The door was open and inside there was a table, two benches, a stove with a neat pile \
of wood beside it and a notebook in which walkers had written their names and the weather. \
Someone had drawn a very good picture of an ibex. The last part of the climb is steep, a \
zigzag of loose stones up the side of a moraine, and it was hot by then, so we went slowly \
and did not talk. Then the ground levelled, and there was the lake, perfectly still, with the \
glacier above it and the reflection of the glacier in it, and a wind so cold coming off the \
ice that we put our jackets back on within a minute. My brother took off his boots and put \
his feet in the water and lasted about four seconds. We sat on a rock for an hour and watched \
the clouds build over the pass. On the way down it started to rain, first a few large drops \
and then a steady soaking downpour, and we arrived back at the village wet through and very \
happy, and ate the biggest plates of potatoes and cheese the inn could bring us.
""",
    """\
A bicycle is one of the most efficient machines ever invented for turning human effort into \
movement. When you push on a pedal, the crank turns the chainring, and the chain carries that \
turning motion to a smaller sprocket on the rear wheel. Because the sprocket has fewer teeth \
than the chainring, the wheel turns several times for every turn of the pedals, and the gears \
let the rider choose how many. A low gear makes it easy to climb a hill but means pedalling \
quickly to go anywhere; a high gear covers more ground with each stroke but needs more force. \
The frame is usually a pair of triangles, a shape that stays rigid without much material, \
which is why a good frame can weigh less than a bag of flour and still carry a heavy rider. \
The wheels are held true by thin spokes under tension, each one pulling the rim towards the \
hub, so that the wheel is supported from above as much as from below. Tyres filled with air \
absorb the small bumps of the road and keep the rolling resistance low. Steering a bicycle is \
less obvious than it looks. To turn left, a rider first steers very slightly to the right, \
which makes the bicycle lean to the left, and then follows the lean around the corner. Most \
people do this without ever knowing it. Keeping a bicycle in good order takes little more \
than regular attention: keep the chain clean and lightly oiled, check the tyre pressure every \
week, make sure the brake pads have not worn down to the metal, and listen for new noises, \
which are almost always the first sign that something needs adjusting. A well looked after \
bicycle can last for decades.
""",
    """\
Dear Martin, thank you for your letter, which arrived on Tuesday with a very official stamp \
and a corner torn off by the postman's dog, who has opinions about envelopes. I was so glad \
to hear that the new job is going well and that you have found a flat with a balcony at last. \
You must send me a photograph of the tomatoes when they come. Things here are much as you left \
them. The river flooded again in March, not as badly as the last time, but enough to ruin the \
carpet in the bakery and to give everyone something to talk about for a month. The council \
has promised a new wall along the bank, and we will believe it when we see it. Your old \
teacher, Mrs Okafor, retired at Easter after thirty-one years at the school, and half the \
town came to the party in the hall. There were speeches, some of them far too long, and a \
cake in the shape of a blackboard, and at the end she stood up and said that she had only \
one piece of advice for all of us, which was to read more and to complain less, and then she \
sat down again to enormous applause. I have been trying to follow it. Your sister visited for \
a weekend in May with the children, who have grown so tall that I hardly recognised them. We \
took them to the coast and they built a sandcastle with a moat and a drawbridge made from a \
piece of driftwood, and they cried when the tide came in and washed it away, and then they \
laughed and built another one further up the beach. Write again soon and tell me everything. \
With love from all of us, and from the dog, who sends his apologies for the envelope.
""",
    """\
Before mechanical clocks, people measured the hours with whatever the world offered them. A \
stick in the ground casts a shadow that moves and shortens through the morning and lengthens \
again through the afternoon, and a sundial is only a careful version of that stick. At night \
and on cloudy days a sundial is useless, so people also measured time with water, letting it \
drip from one vessel into another through a small hole and marking the level at each hour. \
Candles with lines painted on them, and hourglasses filled with fine sand, did the same work \
in a smaller way. The first mechanical clocks appeared in the towers of European churches and \
town halls some seven hundred years ago. They were driven by a heavy weight on a rope, and \
their great difficulty was to make the weight fall slowly and evenly instead of all at once. \
The solution was the escapement, a small device that lets the gears move forward one tooth at \
a time, tick by tick. Those early clocks were not very accurate and often had no minute hand \
at all, but they changed how people lived: the day was now divided into equal hours that rang \
out across the town, and work, markets and prayers began to follow them. The pendulum, \
introduced in the seventeenth century, made clocks many times more accurate, because a \
pendulum of a given length swings at almost exactly the same rate whatever the size of its \
swing. Later came springs, which made clocks small enough to carry, and much later the quartz \
crystal and the atomic clock, which measures time by the vibrations of atoms and would lose \
less than a second in millions of years.
""",
    """\
"Are you sure this is the right road?" asked Lena, looking at the map upside down. "It says \
there should be a bridge." "There was a bridge," said her father. "I think that was the \
bridge." "That was a plank." "It was a small bridge." They drove on in silence for a while, \
between hedges so high that they could see nothing but the strip of grey sky overhead. A \
tractor came the other way and they had to reverse nearly half a mile to a gateway to let it \
pass, and the farmer raised one finger from the steering wheel in thanks, which Lena's father \
said was the local custom and was considered very friendly. "How much further?" "Not far." \
"You said that an hour ago." "And it was true then, too, in a general sort of way." At last \
the lane came out on top of a hill and there, below them, was the sea, wide and silver, with \
the little harbour and the white houses and the church with its crooked tower exactly as it \
had been in the photograph on the fridge at home. Lena stopped complaining at once. Her \
father stopped the car and they both got out and stood there in the wind. "Your grandfather \
was born in the third house from the end," he said. "The blue one. He used to say he could \
hear the boats from his bed." "Can we go and look at it?" "We can go and look at everything. \
We have a whole week." They got back into the car, and this time the road went straight down \
the hill to the harbour without a single wrong turn, which her father said proved that he \
had known the way all along.
""",
    """\
Plants make their own food from light, water and air, a process called photosynthesis. Inside \
the cells of a leaf are tiny green bodies called chloroplasts, and they contain chlorophyll, \
the pigment that gives leaves their colour. Chlorophyll absorbs red and blue light very well \
and reflects green light, which is why most plants look green to us. The energy of the \
absorbed light is used to split water molecules, which the plant has drawn up from the soil \
through its roots and stem. This releases oxygen, which escapes from the leaf through small \
pores on its underside, and it provides the energy to take carbon dioxide from the air and \
build it into sugar. The plant uses that sugar in two ways: it burns some of it to power its \
own growth and repair, and it turns the rest into starch and cellulose, which it stores or \
builds into new stems, leaves and roots. Almost every living thing on land depends on this \
process, directly or indirectly. Animals that eat plants take in the energy that the plants \
captured from sunlight, and animals that eat other animals take it in at one more remove. \
The oxygen we breathe was put into the atmosphere, over hundreds of millions of years, by \
plants and by the tiny organisms in the sea that do the same thing. In autumn, many trees \
stop making chlorophyll as the days grow shorter and colder. The green fades, and the yellow \
and orange pigments that were in the leaves all along become visible, while some trees also \
produce new red pigments before the leaves fall. A gardener who understands all this knows \
why plants need light, why they wilt without water, and why a crowded seedling grows tall \
and thin as it stretches towards the sun.
""",
)
"""More text for the E8 key transform (``_quality.calibrate``), written for it: a walk, how a
bicycle works, a letter, a history of clocks, a dialogue, photosynthesis -- none of it the
``PROMPTS``' subjects, so the scored prompts stay held out."""
CALIBRATION_TEXTS: tuple[str, ...] = (CALIBRATION_TEXT, *CALIBRATION_MORE)
"""Every calibration passage, each run through the model on its own (positions from 0)."""

PROMPTS: tuple[str, ...] = (
    """\
When my grandmother moved out of the farmhouse she had lived in for almost sixty years, the \
family gathered for a weekend to help her sort through what she wanted to keep. It was harder \
than any of us expected. Every drawer held something that started a story: a ribbon from a \
county fair in a year nobody could remember, a bundle of letters from a cousin who had \
emigrated to Canada, a tin of buttons that she insisted were worth saving because you never \
know when you will need a button. My uncle wanted to be efficient about it. He brought a stack \
of cardboard boxes and a roll of tape and a marker, and he labelled the boxes keep, give away \
and throw out before anyone had opened a single cupboard. By the end of the first afternoon \
the keep box was overflowing and the other two were almost empty, and he had stopped trying \
to hurry anybody. We ate dinner at the long kitchen table for what we all understood was the \
last time. Somebody found an old photograph of the same table, taken at a harvest supper when \
my mother was a little girl, and we passed it around and tried to name everyone in it. My \
grandmother knew them all. She told us who had married whom, who had moved to the city, who \
had been the best dancer in the valley and who had fallen off the hay wagon and broken an arm \
the summer the photograph was taken. Later, when the dishes were done, she walked out onto \
the porch and stood looking at the fields for a long time. I went out to stand with her. She \
said that the hardest part was not leaving the house but leaving the view, because she had \
watched those fields change colour with every season of her adult life, and she did not know \
what she would look at now. Then she laughed and said that at least the new apartment had a \
window facing the park, and that she intended to learn the names of every dog that walked \
past it. The next morning we loaded the car, and she did not look back as we drove away, \
although I saw her hand tighten on the strap of her bag when we passed the mailbox at the end \
of the lane. She has lived in the apartment for three years now. She knows the dogs.
""",
    """\
The public library in our neighbourhood is a plain brick building that most people walk past \
without noticing, but on a weekday afternoon it is one of the busiest places in the city. \
Students come after school to do their homework at the long tables, because the library is \
quiet and warm and has reliable internet, which many of them do not have at home. Retired \
people read the newspapers in the armchairs by the window, and some of them have been sitting \
in the same chairs at the same hour for so many years that the staff greet them by name. \
Parents bring small children to the story hour on Tuesdays and Thursdays, where a librarian \
with a remarkable range of voices reads picture books to a circle of toddlers who are only \
sometimes paying attention. There are people looking for jobs, filling in applications on the \
public computers and asking for help with their resumes. There are people who have nowhere \
else to go during the day, and the library lets them stay, as long as they follow the same \
rules as everyone else. The librarians do much more than lend books. They help people fill in \
tax forms, find information about housing and health care, learn to use email, and track \
down obscure facts for curious patrons who have been arguing about something with a friend. \
One of them told me that the most common question she hears is not about books at all but \
about how to print a document from a phone. Another said that the part of the job she finds \
most rewarding is watching a child who arrived at the library unable to read come back a year \
later to borrow chapter books on her own. Funding for the library has been cut several times \
over the past decade, and the opening hours are shorter than they used to be. Every few years \
there is a proposal to close it and move its services online, and every time the \
neighbourhood turns out to the council meeting to object. The people who speak at those \
meetings rarely talk about books. They talk about a place where anyone can go, for free, \
without being asked to buy anything or explain why they are there.
""",
    """\
Learning to cook as an adult is a humbling experience. I grew up in a household where meals \
simply appeared, and by the time I left home I could make toast, boil pasta and not much \
else. For years I lived on sandwiches, takeaway and whatever was on offer in the office \
canteen. What finally changed my habits was not a New Year's resolution but a broken leg. \
Stuck at home for six weeks, bored and tired of delivery food, I started watching cooking \
videos and then, cautiously, trying the simplest recipes. The first few attempts were not \
good. I burned the onions because I did not understand that the heat needed to be lower, \
and I added salt at the end instead of throughout, so everything tasted flat. A friend who \
cooks well came round one evening and watched me chop a carrot, and then very gently took the \
knife out of my hand and showed me how to hold it. That small lesson made more difference \
than any recipe. Once I could chop quickly and safely, cooking stopped feeling like a chore \
and started to feel like something closer to a craft. I learned to taste as I went, to \
trust my nose, and to keep a few basic ingredients in the cupboard so that I could put \
together a meal without a special trip to the shop. I learned that most dishes are built on \
a small number of techniques, and that once you understand how to brown meat, soften \
vegetables and make a simple sauce, you can cook a surprising variety of things. My leg \
healed long ago, but I still cook most evenings. It has become the part of the day when I \
put my phone away and think about nothing except what is in front of me. There is a real \
pleasure in turning a bag of groceries into a meal, and an even greater one in feeding other \
people. I have started inviting friends round on Sundays, and although the food is not always \
a success, nobody has complained yet. Last month I made bread for the first time. It was \
dense and slightly lopsided, and I have never been prouder of anything I have made.
""",
)
